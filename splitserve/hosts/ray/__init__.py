"""splitserve.hosts.ray: a cluster as one Ray Serve application (`splitserve serve-ray`, `serve deploy`, a KubeRay
RayService). `app` builds the deployments (the application builder Serve imports); `policy` is the control law as
Serve's application-level autoscaling policy. Only `app` imports Ray at module load.
"""
