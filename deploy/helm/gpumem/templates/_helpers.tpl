{{- define "gpumem.labels" -}}
app.kubernetes.io/name: gpumem
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpumem.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{- define "gpumem.securityContext" -}}
runAsUser: 0
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* The plugin's: KILL only for --over-cap-action kill, to signal tenants' processes of other users. */}}
{{- define "gpumem.pluginSecurityContext" -}}
runAsUser: 0
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
  {{- if eq .Values.overCapAction "kill" }}
  add: ["KILL"]
  {{- end }}
{{- end -}}
