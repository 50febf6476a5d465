"""Process utilities: how engine processes and ranks start (a forkserver that imported torch once) and how they end with their starter."""
