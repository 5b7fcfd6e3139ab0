"""`python -m benchmarks.capacity`: a capacity run, or one trial's rank (`--worker JOB --rank R`)."""
import sys

from .cli import main

sys.exit(main())
