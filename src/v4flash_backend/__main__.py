import sys

from v4flash_backend.cli import main

sys.exit(main())
