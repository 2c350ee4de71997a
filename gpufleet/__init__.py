"""gpufleet: inventory of GPU hosts; over SSH, show what holds their GPUs and free them safely."""
__version__ = "0.1.0"
