"""`python -m exl3tool` (also what `torchrun -m exl3tool` runs)."""

from exl3tool.cli import main

if __name__ == "__main__":
    main()
