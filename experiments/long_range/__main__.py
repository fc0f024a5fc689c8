"""``python -m experiments.long_range <step>``."""

from .main import main

main()
