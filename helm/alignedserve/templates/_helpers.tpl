{{- define "alignedserve.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "alignedserve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "alignedserve.busUrl" -}}
{{- if .Values.bus.url -}}{{ .Values.bus.url }}{{- else -}}redis://{{ include "alignedserve.fullname" . }}-redis:6379/0{{- end -}}
{{- end -}}

{{/* Environment shared by every service: one frozen config per service reads these. */}}
{{- define "alignedserve.commonEnv" -}}
- name: ALIGNEDSERVE_BUS
  value: {{ include "alignedserve.busUrl" . | quote }}
- name: ALIGNEDSERVE_MODEL
  value: {{ .Values.model | quote }}
- name: ALIGNEDSERVE_DEVICE
  value: {{ .Values.device | quote }}
- name: ALIGNEDSERVE_DTYPE
  value: {{ .Values.dtype | quote }}
- name: ALIGNEDSERVE_METRICS_PORT
  value: {{ .Values.metricsPort | quote }}
- name: UCX_TLS
  value: {{ .Values.ucx.tls | quote }}
- name: ALIGNEDSERVE_ADVERTISE_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}
