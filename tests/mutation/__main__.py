import sys

from tests.mutation.run import main

sys.exit(main())
