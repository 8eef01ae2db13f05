"""splitserve.autoscaler: the control law, Kubernetes operator, local actuator and simulator that set prefill and
decode replica counts from queue depth and TTFT/ITL against SLOs. Not built yet."""
