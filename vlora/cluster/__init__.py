"""A cluster of engine replicas: placement policies, the Ray-backed front and the simulator."""
