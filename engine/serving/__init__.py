"""The engine as a process: its message protocol, the process loop, step reports and the async client the gateway uses."""
