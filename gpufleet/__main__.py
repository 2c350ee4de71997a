"""`python -m gpufleet` is the `gpufleet` command."""
from gpufleet.cli import main

main()
