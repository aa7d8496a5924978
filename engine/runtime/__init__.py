"""Running jobs: the server job, the client job, and the simulator behind `flengine run`."""
