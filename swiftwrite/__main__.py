"""`python -m swiftwrite` (and `torchrun -m swiftwrite`): the command line."""

from .cli import main

if __name__ == "__main__":
    main()
