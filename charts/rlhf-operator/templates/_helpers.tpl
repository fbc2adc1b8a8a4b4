{{- define "rlhf-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rlhf-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rlhf-operator.labels" -}}
{{ include "rlhf-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rlhf-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rlhf-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name: set it when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Lease the replicas elect their leader by: named after the release. */}}
{{- define "rlhf-operator.lease" -}}
{{- include "rlhf-operator.fullname" . -}}
{{- end -}}

{{/*
What the operator does in a namespace it watches: the whole of it, each rule explained
in the chart's README. No wildcards, no Secrets, and no delete but of a failed RayJob
(deleting a job deletes its children through their owner references).
*/}}
{{- define "rlhf-operator.rules" -}}
- apiGroups: [rlhf.dev]
  resources: [rlhfjobs]
  verbs: [get, list, watch]
- apiGroups: [rlhf.dev]
  resources: [rlhfjobs/status]
  verbs: [get, patch]
- apiGroups: [rlhf.dev]
  resources: [rlhfjobs/finalizers]
  verbs: [update]
- apiGroups: [ray.io]
  resources: [rayjobs]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [ray.io]
  resources: [rayclusters]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [configmaps, serviceaccounts]
  verbs: [get, list, watch, create, patch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch]
# The environments a job's operator runs (spec.environments[] without url).
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch]
# Each environment's NetworkPolicy, and each job's own (with networkPolicy.enabled, or
# where an environment has egress).
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch]
# The disruption budget of each environment with several replicas.
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, delete]  # delete: the workers of a Ray head that was lost
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]  # patch: a repeated Event is counted on the one posted
# Kueue (spec.queueName): read why a job waits; deactivate it while suspended.
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [list, patch]
{{- end -}}

{{/* The operator's own pods, as a NetworkPolicy peer (the jobs' policies admit it to
the Ray head's dashboard port, where it asks how a Ray job ended). */}}
{{- define "rlhf-operator.operatorPeer" -}}
namespaceSelector:
  matchLabels: {kubernetes.io/metadata.name: {{ .Release.Namespace }}}
podSelector:
  matchLabels: {{- include "rlhf-operator.selectorLabels" . | nindent 4 }}
{{- end -}}
