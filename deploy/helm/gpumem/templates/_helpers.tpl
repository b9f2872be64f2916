{{- define "gpumem.labels" -}}
app.kubernetes.io/name: gpumem
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- /* The extenders' pods (extender and secondScheduler): what their
metrics Service and monitors select them by. */ -}}
{{- define "gpumem.extenderMetricsLabel" -}}
app.kubernetes.io/component: scheduler-extender
{{- end -}}

{{- define "gpumem.image" -}}
{{ required "image.repository is required: the registry you pushed gpumem's image to (README, \"Deploying it\"), e.g. --set image.repository=registry.example.com/gpumem" .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{- define "gpumem.securityContext" -}}
runAsUser: 0
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* "true" where the daemon mounts a bounded tmpfs for each container's state directory: shim isolation and boundedStateDirs. */}}
{{- define "gpumem.boundedStateDirs" -}}
{{- and .Values.boundedStateDirs (eq .Values.isolation "shim") -}}
{{- end -}}

{{/* The plugin's: privileged where it mounts the containers' state directories (Bidirectional propagation needs it); else KILL only for --over-cap-action kill, to signal tenants' processes of other users. */}}
{{- define "gpumem.pluginSecurityContext" -}}
runAsUser: 0
readOnlyRootFilesystem: true
{{- if eq (include "gpumem.boundedStateDirs" .) "true" }}
privileged: true
{{- else }}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
  {{- if eq .Values.overCapAction "kill" }}
  add: ["KILL"]
  {{- end }}
{{- end }}
{{- end -}}

{{/* Pod-level settings every gpumem pod takes from the values. */}}
{{- define "gpumem.podSettings" -}}
{{- with .Values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The node agent's flags shared by both front ends. */}}
{{- define "gpumem.agentArgs" -}}
- --log-format={{ .Values.logFormat }}
- --state-grace-secs={{ .Values.stateGraceSecs }}
- --ignore-xids={{ .Values.ignoreXids }}
- --health-recovery-secs={{ .Values.healthRecoverySecs }}
- --metrics-addr={{ .Values.metricsAddress }}:{{ .Values.metricsPort }}
{{- end -}}

{{/* A container's args: the chart's own flags (.own, a YAML list), less
each flag extraArgs sets itself, then extraArgs. clap refuses a flag given
twice, so this is how extraArgs overrides what the chart sets. */}}
{{- define "gpumem.args" -}}
{{- $overridden := dict }}
{{- range .root.Values.extraArgs }}
{{- $_ := set $overridden (regexReplaceAll "=.*" (toString .) "") true }}
{{- end }}
{{- range fromYamlArray .own }}
{{- if not (hasKey $overridden (regexReplaceAll "=.*" . "")) }}
- {{ . }}
{{- end }}
{{- end }}
{{- with .root.Values.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The liveness probe, where kubelet can reach /healthz: not on a
loopback-only metrics address, nor with none. */}}
{{- define "gpumem.livenessProbe" -}}
{{- if not (has .Values.metricsAddress (list "127.0.0.1" "localhost" "[::1]")) }}
livenessProbe:
  httpGet:
    path: /healthz
    port: metrics
  initialDelaySeconds: 10
  periodSeconds: 10
  failureThreshold: 6
{{- end }}
{{- end -}}

{{/* What `gpumem extender` does with the API server: read pods and nodes
for its cache, bind pods (the Binding carries gpushare's annotations). */}}
{{- define "gpumem.extenderRules" -}}
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["pods/binding"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
{{- end -}}
