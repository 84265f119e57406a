"""`python -m ngramcache.client.tools.cli`: the client's commands alone (the console script adds the service's)."""

import sys

from ngramcache.client.tools.cli.run import main

sys.exit(main())
