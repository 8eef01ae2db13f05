"""splitserve.hosts: the places a SplitServeCluster runs, side by side, each from the same document: `local`
(`splitserve up`: processes on this machine), `ray` (`splitserve serve-ray`: a Ray Serve application) and `k8s`
(`splitserve operator`: a kopf operator reconciling the custom resource). What every host does alike (a worker's
command line, the worker role of each pool, the bundled Redis, readiness and the ready line) is `common`.
"""
