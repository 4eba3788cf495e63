import sys

from .shim import main

sys.exit(main())
