"""Running one engine as a group of processes, one per rank: process groups, collectives with timeouts."""
