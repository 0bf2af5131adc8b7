{{/*
Names: lapse's objects keep the names the kustomize overlays give them (lapse-bridge, the
ConfigMap `lapse`, ...): func.yaml, the Triggers and docs/deploy.md refer to them, so one
release per namespace. Cluster-scoped objects get the release namespace in their name, so
two installations (or one beside the kustomize package) do not collide; in lapse-system
they are named as the package names them.
*/}}
{{- define "lapse.clusterName" -}}
{{- if eq .ctx.Release.Namespace "lapse-system" -}}
{{ .name }}
{{- else -}}
{{ printf "%s-%s" .ctx.Release.Namespace .name | trunc 63 | trimSuffix "-" }}
{{- end -}}
{{- end }}

{{/* The labels every object carries: Helm's standard ones and the package's part-of. */}}
{{- define "lapse.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: lapse
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{/* A pod's labels: its selector label (app.kubernetes.io/name) and part-of. */}}
{{- define "lapse.podLabels" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/part-of: lapse
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- end }}

{{/* An image reference: [registry/]repository:tag[@digest], the tag defaulting to appVersion. */}}
{{- define "lapse.image" -}}
{{- $image := index .ctx.Values.images .image -}}
{{- $repository := $image.repository -}}
{{- with .ctx.Values.images.registry }}{{ $repository = printf "%s/%s" . $repository }}{{ end -}}
{{- $ref := printf "%s:%s" $repository ($image.tag | default .ctx.Chart.AppVersion) -}}
{{- with $image.digest }}{{ $ref = printf "%s@%s" $ref . }}{{ end -}}
{{ $ref }}
{{- end }}

{{/* image and imagePullPolicy of a lapse container. */}}
{{- define "lapse.containerImage" -}}
image: {{ include "lapse.image" . }}
{{- with .ctx.Values.images.pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end }}

{{/*
What every lapse container shares: resources and securityContext. Takes (dict "ctx" $
"component" <key of components>).
*/}}
{{- define "lapse.containerCommon" -}}
{{- with include "lapse.resources" . | fromYaml }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .ctx.Values.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* What every lapse pod spec shares (not Knative Services': see functions.yaml). */}}
{{- define "lapse.podCommon" -}}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Per component (docs/helm.md, "Placement, identity, resources"): `components.<key>`, each
key falling back to the chart-wide value of the same name. nodeSelector, tolerations,
affinity, topologySpreadConstraints, priorityClassName and resources: the component's
when set, else the chart-wide one (resources then the measured `defaultResources.<key>`).
podAnnotations and podLabels: merged, the component's winning. extraEnv, extraVolumes,
extraVolumeMounts: the chart-wide ones, then the component's. Each takes (dict "ctx" $
"component" <key>); the chart's NATS server takes its values from nats.server
("values" instead of "component").
*/}}
{{- define "lapse.componentValues" -}}
{{- if hasKey . "values" }}{{ toYaml .values }}{{ else }}{{ toYaml (index (.ctx.Values.components | default dict) .component | default dict) }}{{ end -}}
{{- end }}

{{/* The component's ServiceAccount: serviceAccount.name, else the chart's name for it. */}}
{{- define "lapse.serviceAccountName" -}}
{{- $c := include "lapse.componentValues" . | fromYaml -}}
{{- (($c.serviceAccount | default dict).name) | default .default -}}
{{- end }}

{{/* Whether the chart makes the component's ServiceAccount (serviceAccount.create, default true). */}}
{{- define "lapse.serviceAccountCreate" -}}
{{- $c := include "lapse.componentValues" . | fromYaml -}}
{{- $account := $c.serviceAccount | default dict -}}
{{- if or (not (hasKey $account "create")) $account.create }}true{{ end -}}
{{- end }}

{{/*
The scheduling fields of a pod spec, at .indent (nothing when none is set). A topology
spread constraint without a labelSelector gets the pod's own selector labels (.selector):
a chart-wide constraint cannot name each component's, and a null selector matches no pod.
*/}}
{{- define "lapse.placement" -}}
{{- $c := include "lapse.componentValues" . | fromYaml -}}
{{- $v := .ctx.Values -}}
{{- $fields := dict -}}
{{- range $name := list "nodeSelector" "tolerations" "affinity" "priorityClassName" }}
{{- with index $c $name | default (index $v $name) }}{{ $_ := set $fields $name . }}{{ end }}
{{- end }}
{{- with $c.topologySpreadConstraints | default $v.topologySpreadConstraints }}
{{- $constraints := list }}
{{- range . }}
{{- $constraint := deepCopy . }}
{{- if not (hasKey $constraint "labelSelector") }}{{ $_ := set $constraint "labelSelector" (dict "matchLabels" $.selector) }}{{ end }}
{{- $constraints = append $constraints $constraint }}
{{- end }}
{{- $_ := set $fields "topologySpreadConstraints" $constraints }}
{{- end }}
{{- with $fields }}{{ toYaml . | nindent $.indent }}{{ end -}}
{{- end }}

{{/* More labels of a pod, at .indent (the chart's own selector labels cannot be replaced). */}}
{{- define "lapse.podLabels.extra" -}}
{{- $c := include "lapse.componentValues" . | fromYaml -}}
{{- $labels := merge (deepCopy ($c.podLabels | default dict)) (.ctx.Values.podLabels | default dict) -}}
{{- with omit $labels "app.kubernetes.io/name" "app.kubernetes.io/part-of" "app.kubernetes.io/instance" }}{{ toYaml . | nindent $.indent }}{{ end -}}
{{- end }}

{{/* More annotations of a pod, at .indent (not the chart's checksums). */}}
{{- define "lapse.podAnnotations.extra" -}}
{{- $c := include "lapse.componentValues" . | fromYaml -}}
{{- $annotations := merge (deepCopy ($c.podAnnotations | default dict)) (.ctx.Values.podAnnotations | default dict) -}}
{{- with omit $annotations "checksum/config" "checksum/telemetry" "checksum/nats-conf" }}{{ toYaml . | nindent $.indent }}{{ end -}}
{{- end }}

{{/* A container's resources: the component's, else the chart-wide, else the measured default. */}}
{{- define "lapse.resources" -}}
{{- $c := include "lapse.componentValues" . | fromYaml -}}
{{- $measured := index (.ctx.Values.defaultResources | default dict) (.component | default "") | default dict -}}
{{- toYaml ($c.resources | default .ctx.Values.resources | default $measured) -}}
{{- end }}

{{/* extraEnv, extraVolumeMounts, extraVolumes (.field), at .indent: the chart-wide ones, then the component's. */}}
{{- define "lapse.extra" -}}
{{- $c := include "lapse.componentValues" . | fromYaml -}}
{{- with concat (index .ctx.Values .field | default list) (index $c .field | default list) }}{{ toYaml . | nindent $.indent }}{{ end -}}
{{- end }}

{{/*
A lapse pod's own NATS identity (docs/deploy.md, "NATS identities"): the user, and its
password from the users Secret, the only key mounted. `lapse.natsIdentity.env`,
`.mounts` and `.volumes` take (dict "ctx" $ "user" <identity>).
*/}}
{{- define "lapse.natsIdentity.env" -}}
- {name: LAPSE_NATS__USER, value: {{ .user }}}
- {name: LAPSE_NATS__PASSWORD_FILE, value: /etc/lapse-nats/password}
{{- end }}

{{/*
What every lapse process (not the chart's NATS server) takes besides its own variables: the
NATS URL from the ConfigMap `lapse` (the one place it is set), and the telemetry settings
from the ConfigMap `lapse-telemetry` (telemetry.yaml). Ends a container's `env` list.
*/}}
{{- define "lapse.processEnv" -}}
- name: LAPSE_NATS__URL
  valueFrom: {configMapKeyRef: {name: lapse, key: nats-url}}
{{- end }}

{{- define "lapse.processEnvFrom" -}}
envFrom:
  - configMapRef: {name: lapse-telemetry}
{{- end }}

{{/* Annotations that roll a pod when lapse.yaml or the telemetry settings change. */}}
{{- define "lapse.checksums" -}}
checksum/config: {{ include "lapse.config" . | sha256sum }}
checksum/telemetry: {{ include "lapse.telemetry" . | sha256sum }}
{{- end }}

{{- define "lapse.configMounts" -}}
{{- include "lapse.tmpMount" . }}
- {name: config, mountPath: /etc/lapse, readOnly: true}
- {name: nats-password, mountPath: /etc/lapse-nats, readOnly: true}
{{- if .Values.nats.tls.enabled }}
- {name: nats-tls, mountPath: /etc/lapse-nats-tls, readOnly: true}
{{- end }}
{{- end }}

{{/* lapse.yaml (ConfigMap `lapse`) and the pod's NATS password and TLS files. */}}
{{- define "lapse.configVolumes" -}}
- name: config
  configMap:
    name: lapse
    items: [{key: lapse.yaml, path: lapse.yaml}]
- name: nats-password
  secret:
    secretName: {{ .ctx.Values.nats.auth.usersSecret }}
    items: [{key: {{ .user }}, path: password}]
{{- include "lapse.natsTlsVolume" .ctx }}
{{- include "lapse.tmpVolume" .ctx }}
{{- end }}

{{/* With a read-only root filesystem, /tmp is an emptyDir of the pod's own. */}}
{{- define "lapse.readOnlyRoot" -}}
{{- if and .Values.securityContext .Values.securityContext.readOnlyRootFilesystem }}true{{ end -}}
{{- end }}

{{- define "lapse.tmpMount" -}}
{{- if include "lapse.readOnlyRoot" . }}
- {name: tmp, mountPath: /tmp}
{{- end }}
{{- end }}

{{- define "lapse.tmpVolume" -}}
{{- if include "lapse.readOnlyRoot" . }}
- {name: tmp, emptyDir: {sizeLimit: 64Mi}}
{{- end }}
{{- end }}

{{/*
TLS to NATS: the CA that signed the servers' certificate (and with clientCertificate a
client certificate and key), read-only at /etc/lapse-nats-tls where lapse.yaml's
nats.tls.* point. lapse needs no key of the servers'.
*/}}
{{- define "lapse.natsTlsVolume" -}}
{{- if .Values.nats.tls.enabled }}
- name: nats-tls
  secret:
    secretName: {{ .Values.nats.tls.secretName }}
    items:
      - {key: ca.crt, path: ca.crt}
      {{- if .Values.nats.tls.clientCertificate }}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      {{- end }}
{{- end }}
{{- end }}

{{/* The NATS URL: nats.url, else the NATS this chart runs. */}}
{{- define "lapse.natsUrl" -}}
{{- if .Values.nats.url -}}
{{ .Values.nats.url }}
{{- else if .Values.nats.server.enabled -}}
{{ printf "nats://nats.%s.svc:4222" .Release.Namespace }}
{{- else -}}
{{ fail "nats.url is required when nats.server.enabled is false" }}
{{- end -}}
{{- end }}

{{/*
lapse.yaml: `config`, with what the chart owns set from the values it comes from (the NATS
TLS files, the cleaned namespaces, policies, kinds). The NATS URL is not in it: every pod
takes it from the ConfigMap's nats-url (LAPSE_NATS__URL).
*/}}
{{- define "lapse.config" -}}
{{- $config := deepCopy (.Values.config | default dict) -}}
{{- $nats := deepCopy (get $config "nats" | default dict) -}}
{{- if .Values.nats.tls.enabled -}}
{{- $tls := dict "ca_file" "/etc/lapse-nats-tls/ca.crt" -}}
{{- if .Values.nats.tls.clientCertificate -}}
{{- $_ := set $tls "cert_file" "/etc/lapse-nats-tls/tls.crt" -}}
{{- $_ := set $tls "key_file" "/etc/lapse-nats-tls/tls.key" -}}
{{- end -}}
{{- $_ := set $nats "tls" $tls -}}
{{- end -}}
{{- $_ := set $config "nats" $nats -}}
{{- $safety := deepCopy (get $config "safety" | default dict) -}}
{{- $namespaces := deepCopy (get $safety "namespaces" | default dict) -}}
{{- $_ := set $namespaces "include" .Values.namespaces -}}
{{- $_ := set $safety "namespaces" $namespaces -}}
{{- $_ := set $config "safety" $safety -}}
{{- with .Values.policies }}{{ $_ := set $config "policies" . }}{{ end -}}
{{- $_ := set $config "kinds" .Values.kinds -}}
{{ toYaml $config }}
{{- end }}

{{/* The API group of a declared kind (its api_version without the version). */}}
{{- define "lapse.apiGroup" -}}
{{- if contains "/" .api_version }}{{ index (splitList "/" .api_version) 0 }}{{ end -}}
{{- end }}

{{/* get/list/watch on every run kind: the built-in ones and the declared (a list). */}}
{{- define "lapse.readRules" -}}
- apiGroups: [argoproj.io]
  resources: [workflows]
  verbs: [get, list, watch]
- apiGroups: [tekton.dev]
  resources: [pipelineruns, taskruns]
  verbs: [get, list, watch]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch]
- apiGroups: [trainer.kubeflow.org]
  resources: [trainjobs]
  verbs: [get, list, watch]
- apiGroups: [ray.io]
  resources: [rayjobs]
  verbs: [get, list, watch]
- apiGroups: [jobset.x-k8s.io]
  resources: [jobsets]
  verbs: [get, list, watch]
- apiGroups: [sparkoperator.k8s.io]
  resources: [sparkapplications]
  verbs: [get, list, watch]
{{- range . }}
- apiGroups: [{{ include "lapse.apiGroup" . | quote }}]
  resources: [{{ .resource }}]
  verbs: [get, list, watch]
{{- end }}
{{- end }}

{{/* A label selector of equalities (k=v,k2=v2: a declared kind's finished_selector) as matchLabels YAML. */}}
{{- define "lapse.selectorLabels" -}}
{{- range splitList "," . }}
{{- $pair := regexSplit "==?" (trim .) 2 }}
{{- if ne (len $pair) 2 }}{{ fail (printf "kinds: finished_selector %q: only key=value terms are supported by the ApiServerSource here" .) }}{{ end }}
{{ trim (index $pair 0) }}: {{ trim (index $pair 1) | quote }}
{{- end }}
{{- end }}

{{/* The metrics port of a lapse container (metrics.port), if any. */}}
{{- define "lapse.metricsPort" -}}
{{- with .Values.metrics.port }}
- {name: metrics, containerPort: {{ . }}}
{{- end }}
{{- end }}

{{/* The data of the ConfigMap lapse-telemetry. */}}
{{- define "lapse.telemetry" -}}
{{- $data := dict }}
{{- with .Values.metrics.port }}{{ $_ := set $data "LAPSE_PROMETHEUS_PORT" (toString .) }}{{ end }}
{{- with .Values.otel.endpoint }}{{ $_ := set $data "OTEL_EXPORTER_OTLP_ENDPOINT" . }}{{ end }}
{{- range $name, $value := .Values.otel.env }}{{ $_ := set $data $name (toString $value) }}{{ end }}
{{- toYaml $data }}
{{- end }}
