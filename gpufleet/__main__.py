"""`python -m gpufleet` is the `gpufleet` command."""
from .cli import main

main()
