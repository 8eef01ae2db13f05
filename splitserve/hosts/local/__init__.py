"""splitserve.hosts.local: a cluster as processes on this machine (`splitserve up`). `launcher` starts, watches
and stops them; `autoscale` is the control law's local actuator (`up --autoscale`), which sees the launcher only
through a small protocol.
"""
