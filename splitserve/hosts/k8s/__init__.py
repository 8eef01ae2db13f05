"""splitserve.hosts.k8s: a cluster on Kubernetes. A kopf operator (`splitserve operator`) reconciles each
SplitServeCluster into the gateway, prefill and decode Deployments, their Services and PodDisruptionBudgets,
the ConfigMap holding the rendered config, the bundled Redis and one SplitServeRole per role (the scale
subresource HPA and KEDA drive), and reports replicas and conditions in the resource's status; with
`autoscaling.mode` slo it is the control law's Kubernetes actuator (`slo`). The CRDs and the Helm chart's values
schema are generated from the configuration model here too (`crd`, `chart_values`).

Only `handlers` and `run` import kopf (and `kube` the kubernetes client); everything they call is plain functions
over dicts, tested on its own.
"""
