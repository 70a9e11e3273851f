"""``dsec top``: a live terminal view of a pool, its most troubled workers first (the command: dsec.cli_top)."""
