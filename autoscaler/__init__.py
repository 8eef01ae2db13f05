"""splitserve.autoscaler: the SLO control law that sets prefill and decode replicas from queue depth and TTFT/ITL
against the objectives (`law.decide`: observations in, a decision with its reason out), the replica profile it
sizes pools with, and a trace-driven simulator (`autoscaler.sim`) that runs the same law against the router's
real policy objects. The simulator and the hosts (`splitserve.hosts`: the Kubernetes operator, `splitserve up
--autoscale`, Ray Serve's policy) are its actuators. No torch, no engine."""
