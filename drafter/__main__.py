import sys

from drafter.cli import main

sys.exit(main())
