"""``python -m dsa_triton.bench``: see :mod:`dsa_triton.bench.run`."""
import sys

from .run import main

sys.exit(main())
