import sys

from rtc_server.cli import main

sys.exit(main())
