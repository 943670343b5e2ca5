{{/* The chart name, truncated to the 63 characters of a label value. */}}
{{- define "hybridkv.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name: the release name when it already contains the chart name. */}}
{{- define "hybridkv.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "hybridkv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hybridkv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "hybridkv.labels" -}}
{{ include "hybridkv.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: hybridkv
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "hybridkv.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "hybridkv.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "hybridkv.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "hybridkv.sidecarImage" -}}
{{- printf "%s:%s" .Values.sidecarImage.repository (default .Chart.AppVersion .Values.sidecarImage.tag) -}}
{{- end -}}

{{/* The namespaces served when not cluster-wide: the release namespace first, then the extra ones. */}}
{{- define "hybridkv.watchedNamespaces" -}}
{{- $namespaces := list .Release.Namespace -}}
{{- range .Values.watch.namespaces -}}
{{- if not (has . $namespaces) -}}
{{- $namespaces = append $namespaces . -}}
{{- end -}}
{{- end -}}
{{- join "," $namespaces -}}
{{- end -}}
