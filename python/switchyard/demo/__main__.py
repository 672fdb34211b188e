"""python -m switchyard.demo: see switchyard.demo."""
import sys

from switchyard.demo import main

sys.exit(main())
