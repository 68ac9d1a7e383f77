import sys

from bench._cli import main

sys.exit(main())
