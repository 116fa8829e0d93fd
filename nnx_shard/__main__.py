"""python -m nnx_shard: the same as the nnx-shard command."""

import sys

from nnx_shard.cli import main

sys.exit(main())
