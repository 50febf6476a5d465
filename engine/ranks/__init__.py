"""An engine as several processes, at the top of the engine: the engine process starting, meeting and stopping
its follower ranks (``engine_ranks``), and a follower rank's main loop (``follower``), which builds its rank as
the engine process builds its own and steps as its plans say."""
