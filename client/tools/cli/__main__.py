"""`python -m ngramcache.client.cli`: the client's commands alone (the console script adds the service's)."""

import sys

from ngramcache.client.cli.run import main

sys.exit(main())
