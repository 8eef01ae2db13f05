{{/* The release's base name (Kubernetes names are at most 63 characters). */}}
{{- define "splitserve.fullname" -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{/* The SplitServeCluster's name: cluster.name, or the release name. */}}
{{- define "splitserve.clusterName" -}}
{{- default .Release.Name .Values.cluster.name | trunc 55 | trimSuffix "-" -}}
{{- end -}}

{{- define "splitserve.operatorName" -}}
{{- printf "%s-operator" (include "splitserve.fullname" .) -}}
{{- end -}}

{{- define "splitserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
app.kubernetes.io/name: splitserve
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
app.kubernetes.io/part-of: splitserve
{{- end -}}

{{- define "splitserve.operatorSelector" -}}
app.kubernetes.io/name: splitserve-operator
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end -}}

{{/* Pod selectors of the cluster's components, as the operator labels them. */}}
{{- define "splitserve.componentSelector" -}}
splitserve.dev/cluster: {{ include "splitserve.clusterName" .root | quote }}
splitserve.dev/role: {{ .role }}
{{- end -}}
