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
