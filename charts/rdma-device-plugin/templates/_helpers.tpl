{{/*
Helpers, all namespaced by the chart name.
*/}}

{{- define "rdma-device-plugin.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name, cut so that "<fullname>-exclusive" (the longest suffix) stays a valid 63-char name.
*/}}
{{- define "rdma-device-plugin.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rdma-device-plugin.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The namespace of every namespaced object (namespaceOverride, as bitnami charts have it). */}}
{{- define "rdma-device-plugin.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride }}
{{- end }}

{{- define "rdma-device-plugin.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rdma-device-plugin.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Label key that tells the two DaemonSets (and their pods) apart. Fixed and chart-owned: it is part
of the immutable DaemonSet selectors, so it must not follow modeLabelKey (a node label the user may
rename) or `helm upgrade` could not patch the DaemonSets.
*/}}
{{- define "rdma-device-plugin.modeKey" -}}rdma.lingjun.io/mode{{- end }}

{{/*
Node label the fleet playbooks set on a node they validated (true) or found failing (false), with the
annotation rdma.lingjun.io/validated-at (RFC 3339). validation.required makes the DaemonSets require
it; the alerts read it through kube-state-metrics.
*/}}
{{- define "rdma-device-plugin.validatedKey" -}}{{ .Values.validation.labelKey }}{{- end }}

{{/*
Labels the chart owns: podLabels and commonLabels may not set them (schema + _validate.tpl).
*/}}
{{- define "rdma-device-plugin.reservedLabels" -}}
{{- toJson (list "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component" "app.kubernetes.io/managed-by" "app.kubernetes.io/version" "helm.sh/chart" (include "rdma-device-plugin.modeKey" .)) }}
{{- end }}

{{/*
Pod template labels: the selector labels plus what never changes between chart releases. No chart
version and no image tag (as the NVIDIA chart does), so a chart-only release rolls no plugin pod.
*/}}
{{- define "rdma-device-plugin.podLabels" -}}
{{ include "rdma-device-plugin.selectorLabels" . }}
app.kubernetes.io/part-of: rdma-device-plugin
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "rdma-device-plugin.labels" -}}
helm.sh/chart: {{ include "rdma-device-plugin.chart" . }}
{{ include "rdma-device-plugin.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rdma-device-plugin
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "rdma-device-plugin.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rdma-device-plugin.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image reference: [registry/]repository(@digest|:tag), as bitnami's common.images.image builds it:
global.imageRegistry overrides image.registry, and the repository holds no host. A repository that
starts with a registry host (its first component has a "." or ":" or is "localhost", Docker's rule) is
taken whole: image.registry does not apply to it, and with global.imageRegistry set _validate.tpl
fails rather than render "<mirror>/<host>/<path>".
*/}}
{{- define "rdma-device-plugin.repositoryHasHost" -}}
{{- $first := regexFind "^[^/]+/" .Values.image.repository | trimSuffix "/" }}
{{- if and $first (or (contains "." $first) (contains ":" $first) (eq $first "localhost")) }}true{{ end }}
{{- end }}

{{- define "rdma-device-plugin.image" -}}
{{- $registry := ((.Values.global | default dict).imageRegistry) | default .Values.image.registry | default "" }}
{{- $repository := .Values.image.repository }}
{{- if and $registry (not (include "rdma-device-plugin.repositoryHasHost" .)) }}
{{- $repository = printf "%s/%s" $registry .Values.image.repository }}
{{- end }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" $repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/*
Is an API served? Call with (dict "root" $ "api" "group/version/Kind" "minKube" "1.30.0-0").
On install/upgrade Helm fills .Capabilities.APIVersions from discovery, which lists every
group/version AND group/version/Kind, so the kind is looked up exactly. helm template / lint know
only group/versions (never a kind) unless --api-versions says more: then the kube version decides.
Returns "true" or "".
*/}}
{{- define "rdma-device-plugin.hasAPI" -}}
{{- $caps := .root.Capabilities }}
{{- $group := regexReplaceAll "^([^/]+/[^/]+)/.*$" .api "${1}/" }}
{{- $discovered := false }}
{{- range $caps.APIVersions }}{{ if hasPrefix $group . }}{{ $discovered = true }}{{ end }}{{ end }}
{{- if $caps.APIVersions.Has .api }}true
{{- else if and (not $discovered) .minKube (semverCompare (printf ">=%s" .minKube) $caps.KubeVersion.Version) }}true
{{- end }}
{{- end }}

{{/*
Every resource name the plugin advertises: resourceName first, then extraResources.
Returned as JSON (templates cannot return lists): use with fromJsonArray.
*/}}
{{- define "rdma-device-plugin.resourceNames" -}}
{{- $names := list .Values.resourceName }}
{{- range .Values.extraResources }}
{{- $names = append $names .name }}
{{- end }}
{{- toJson $names }}
{{- end }}

{{/*
The resources whose pools numaPools splits (shared mode): the plugin also advertises
<name>-numa<N> (one per NUMA node of the node, unknown here) and <name>-local for each. As JSON.
*/}}
{{- define "rdma-device-plugin.numaPoolNames" -}}
{{- $names := list }}
{{- if .Values.numaPools }}{{ $names = append $names .Values.resourceName }}{{ end }}
{{- range .Values.extraResources }}
{{- if .numaPools }}{{ $names = append $names .name }}{{ end }}
{{- end }}
{{- toJson $names }}
{{- end }}

{{/*
The plugin's config file for one mode. Call with (dict "root" $ "mode" "shared").
Exactly the shape rdma_device_plugin.config.PluginConfig accepts (version v1, no extra keys).
pluginVersion: the plugin release this config is written for (appVersion): an older plugin image
refuses it naming both versions, rather than failing on a key it does not know.
*/}}
{{- define "rdma-device-plugin.config" -}}
{{- $v := .root.Values }}
{{- /* numaPools is a shared-mode split: the exclusive config leaves it out (its devices carry each NIC's NUMA node) */}}
{{- $shared := eq .mode "shared" }}
{{- $resources := list (dict "name" $v.resourceName "sharedDevices" (int $v.sharedDevices) "selectors" $v.selectors) }}
{{- if and $shared $v.numaPools }}{{ $_ := set (first $resources) "numaPools" true }}{{ end }}
{{- range $v.extraResources }}
{{- $r := dict "name" .name "sharedDevices" (int (ternary .sharedDevices 1000 (hasKey . "sharedDevices"))) }}
{{- with .selectors }}{{ $_ := set $r "selectors" . }}{{ end }}
{{- if and $shared .numaPools }}{{ $_ := set $r "numaPools" true }}{{ end }}
{{- $resources = append $resources $r }}
{{- end }}
{{- $cfg := dict
      "version" "v1"
      "pluginVersion" .root.Chart.AppVersion
      "mode" .mode
      "resources" $resources
      "health" $v.health
      "rediscoveryIntervalSeconds" $v.rediscoveryIntervalSeconds
      "charDevices" $v.charDevices
      "env" $v.env
      "nonHostNetwork" $v.nonHostNetwork
      "workloadEnv" $v.workloadEnv
      "cdi" (dict "enabled" $v.cdi.enabled "kind" $v.cdi.kind) }}
{{- toYaml $cfg }}
{{- end }}

{{/*
Node affinity of the DaemonSet of one mode. Call with (dict "root" $ "mode" "shared").
Takes .Values.affinity and ANDs the mode-label expression into every nodeSelectorTerm (terms are
ORed by Kubernetes). The default mode needs "label absent OR label == mode", which one term cannot
say, so every term is doubled: one copy with DoesNotExist, one with In [mode]. A node whose label
holds any other value gets neither DaemonSet (see NOTES).
With the DRA driver rendered (driver: dra, or dra.enabled) the API label is ANDed the same way:
(dict ... "api" "devicePlugin"|"dra"); without it the device plugin's affinity stays as it was
(no rollout of its pods on upgrade).
*/}}
{{- define "rdma-device-plugin.draEnabled" -}}
{{- if or (eq .Values.driver "dra") .Values.dra.enabled }}true{{ end }}
{{- end }}

{{- define "rdma-device-plugin.affinity" -}}
{{- $v := .root.Values }}
{{- $key := $v.modeLabelKey }}
{{- $affinity := deepCopy ($v.affinity | default dict) }}
{{- $nodeAffinity := get $affinity "nodeAffinity" | default dict }}
{{- $required := get $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" | default dict }}
{{- $terms := get $required "nodeSelectorTerms" | default (list (dict)) }}
{{- $variants := list (dict "key" $key "operator" "In" "values" (list .mode)) }}
{{- if eq .mode $v.mode }}
{{- $variants = list (dict "key" $key "operator" "DoesNotExist") (dict "key" $key "operator" "In" "values" (list .mode)) }}
{{- end }}
{{- $validated := list }}
{{- if ($v.validation | default dict).required }}
{{- $validated = list (dict "key" (include "rdma-device-plugin.validatedKey" .root) "operator" "In" "values" (list "true")) }}
{{- end }}
{{- $apis := list list }}
{{- if include "rdma-device-plugin.draEnabled" .root }}
{{- $api := .api | default "devicePlugin" }}
{{- $apiKey := $v.driverLabelKey }}
{{- $apis = list (list (dict "key" $apiKey "operator" "In" "values" (list $api))) }}
{{- if eq $api $v.driver }}
{{- $apis = list (list (dict "key" $apiKey "operator" "DoesNotExist")) (list (dict "key" $apiKey "operator" "In" "values" (list $api))) }}
{{- end }}
{{- end }}
{{- $newTerms := list }}
{{- range $term := $terms }}
{{- range $expr := $variants }}
{{- range $apiExprs := $apis }}
{{- $t := deepCopy $term }}
{{- $_ := set $t "matchExpressions" (concat (get $t "matchExpressions" | default list) (list $expr) $apiExprs $validated) }}
{{- $newTerms = append $newTerms $t }}
{{- end }}
{{- end }}
{{- end }}
{{- $_ := set $required "nodeSelectorTerms" $newTerms }}
{{- $_ := set $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" $required }}
{{- $_ := set $affinity "nodeAffinity" $nodeAffinity }}
{{- toYaml $affinity }}
{{- end }}

{{/*
Container securityContext: the least privilege that works, with .Values.securityContext merged over.
The plugin runs as root because it must create its gRPC socket in the kubelet's root-owned
device-plugins directory (0755 root:root) and the kubelet must be able to connect to it; it needs no
capability for that (the directory owner is root), so every capability is dropped.
privileged: true (only if asked for) drops allowPrivilegeEscalation: false, which Kubernetes rejects
next to privileged.
*/}}
{{- define "rdma-device-plugin.securityContext" -}}
{{- $sc := dict
      "runAsUser" 0
      "runAsNonRoot" false
      "readOnlyRootFilesystem" true
      "seccompProfile" (dict "type" "RuntimeDefault") }}
{{- if .Values.privileged }}
{{- $_ := set $sc "privileged" true }}
{{- else }}
{{- $_ := set $sc "privileged" false }}
{{- $_ := set $sc "allowPrivilegeEscalation" false }}
{{- $_ := set $sc "capabilities" (dict "drop" (list "ALL")) }}
{{- end }}
{{- toYaml (mergeOverwrite $sc (deepCopy .Values.securityContext)) }}
{{- end }}

{{/*
CEL building blocks of the admission policies. Kept to has()/exists()/all()/filter()/map()/matches()/
size()/string()/in, so that both Kubernetes CEL and cel-python (the chart tests) evaluate them.

celContainers: the containers and initContainers of the pod spec expression .spec.
*/}}
{{- define "rdma-device-plugin.celContainers" -}}
{{- printf "(has(%s.initContainers) ? %s.containers + %s.initContainers : %s.containers)" .spec .spec .spec .spec }}
{{- end }}

{{/*
celRequestsRdma: does container .c request one of the plugin's resources, in limits or requests, with a
quantity other than 0? `rdma/hca: 0` is no request (charts render a switched-off toggle as 0): the API
server hands admission the canonical quantity, "0". string() also reads the ints of a hand-made object.
Call with (dict "root" $ "c" "c").
*/}}
{{- define "rdma-device-plugin.celRequestsRdma" -}}
{{- $names := include "rdma-device-plugin.resourceNames" .root | fromJsonArray }}
{{- $r := include "rdma-device-plugin.celList" $names }}
{{- /* numaPools: <name>-numa<N> and <name>-local, by a pattern ("." written [.]: no escapes in CEL) */}}
{{- $split := list }}
{{- range (include "rdma-device-plugin.numaPoolNames" .root | fromJsonArray) }}{{ $split = append $split (replace "." "[.]" .) }}{{ end }}
{{- $c := .c }}
{{- $parts := list }}
{{- range $field := list "limits" "requests" }}
{{- $parts = append $parts (printf "(has(%s.resources.%s) && %s.exists(r, r in %s.resources.%s && string(%s.resources.%s[r]) != '0'))" $c $field $r $c $field $c $field) }}
{{- if $split }}
{{- $parts = append $parts (printf "(has(%s.resources.%s) && %s.resources.%s.exists(r, r.matches('^(%s)-(numa[0-9]+|local)$') && string(%s.resources.%s[r]) != '0'))" $c $field $c $field (join "|" $split) $c $field) }}
{{- end }}
{{- end }}
{{- printf "has(%s.resources) && (%s)" $c (join " || " $parts) }}
{{- end }}

{{/*
celHasIpcLock: does container .c run with CAP_IPC_LOCK? Exactly as containerd's CRI applies the
securityContext (internal/cri/opts WithCapabilities): a privileged container gets every capability and
its capabilities field is not applied; otherwise ALL in add (any case) grants all, ALL in drop then
removes all, then every named add is applied as "CAP_" + upper(name), then every named drop. So
add [ALL] + drop [ALL], add [ALL] + drop [IPC_LOCK] and add [IPC_LOCK] + drop [ipc_lock] leave no
IPC_LOCK, while drop [ALL] + add [IPC_LOCK] keeps it.
*/}}
{{- define "rdma-device-plugin.celHasIpcLock" -}}
{{- $sc := printf "%s.securityContext" .c }}
{{- $caps := printf "%s.capabilities" $sc }}
{{- $adds := printf "(has(%s.add) ? %s.add : [])" $caps $caps }}
{{- $drops := printf "(has(%s.drop) ? %s.drop : [])" $caps $caps }}
{{- printf "has(%s) && ((has(%s.privileged) && %s.privileged == true) || (has(%s) && !%s.exists(d, d.matches('^(?i)ipc_lock$')) && (%s.exists(a, a.matches('^(?i)ipc_lock$')) || (%s.exists(a, a.matches('^(?i)all$')) && !%s.exists(d, d.matches('^(?i)all$'))))))" $sc $sc $sc $caps $drops $adds $adds $drops }}
{{- end }}

{{/*
celNonRoot: is container .c of pod spec .spec known to run as a user other than root? The container's
runAsUser wins over the pod's; without either, runAsNonRoot (container over pod) means the kubelet
only starts it as non-root. Unknown (the image's USER) counts as root: no warning.
*/}}
{{- define "rdma-device-plugin.celNonRoot" -}}
{{- $c := printf "%s.securityContext" .c }}
{{- $p := printf "%s.securityContext" .spec }}
{{- printf "((has(%s) && has(%s.runAsUser)) ? %s.runAsUser != 0 : (has(%s) && has(%s.runAsUser)) ? %s.runAsUser != 0 : (has(%s) && has(%s.runAsNonRoot)) ? %s.runAsNonRoot == true : (has(%s) && has(%s.runAsNonRoot) && %s.runAsNonRoot == true))" $c $c $c $p $p $p $c $c $c $p $p $p }}
{{- end }}

{{/* A CEL list literal of strings: ['a', 'b']. */}}
{{- define "rdma-device-plugin.celList" -}}
{{- $quoted := list }}
{{- range . }}{{ $quoted = append $quoted (printf "'%s'" .) }}{{ end }}
{{- printf "[%s]" (join ", " $quoted) }}
{{- end }}

{{/*
PromQL label matchers that select the plugin's series (alerts and dashboard): metrics.jobSelector, or
the job prometheus-operator gives the targets of the chart's ServiceMonitor (the Service name).
*/}}
{{- define "rdma-device-plugin.promSelector" -}}
{{- .Values.metrics.jobSelector | default (printf "job=\"%s-metrics\"" (include "rdma-device-plugin.fullname" .)) }}
{{- end }}

{{/* kube-state-metrics matchers followed by a comma, or nothing. */}}
{{- define "rdma-device-plugin.promKsmSelector" -}}
{{- with .Values.metrics.prometheusRule.kubeStateMetrics.selector }}{{ . }},{{ end }}
{{- end }}

{{/*
The nodes that should run the plugin, one series per node (label node), from kube-state-metrics'
kube_node_labels: any of kubeStateMetrics.rdmaNodeLabels; with validation.required only those the
fleet playbooks validated (the DaemonSets run nowhere else).
*/}}
{{- define "rdma-device-plugin.promRdmaNodes" -}}
{{- $ksm := include "rdma-device-plugin.promKsmSelector" . }}
{{- $any := list }}
{{- range .Values.metrics.prometheusRule.kubeStateMetrics.rdmaNodeLabels }}{{ $any = append $any (printf "kube_node_labels{%s%s}" $ksm .) }}{{ end }}
{{- $expr := printf "group by (node) (%s)" (join " or " $any) }}
{{- if .Values.validation.required }}
{{- $key := regexReplaceAll "[^a-zA-Z0-9_]" (include "rdma-device-plugin.validatedKey" .) "_" }}
{{- $expr = printf "(%s and on(node) kube_node_labels{%slabel_%s=\"true\"})" $expr $ksm $key }}
{{- end }}
{{- $expr }}
{{- end }}

{{/*
Metrics behind auth (metrics.auth.enabled with metrics.enabled): "true" or "". The serving
certificate's Secret, the plugin's flags, its mount and volume, shared by both DaemonSets.
*/}}
{{- define "rdma-device-plugin.metricsAuth" -}}
{{- if and .Values.metrics.enabled .Values.metrics.auth.enabled }}true{{ end }}
{{- end }}

{{- define "rdma-device-plugin.metricsTlsSecret" -}}
{{- .Values.metrics.auth.tlsSecretName | default (printf "%s-metrics-tls" (include "rdma-device-plugin.fullname" .)) }}
{{- end }}

{{/* The DNS name the serving certificate carries and scrapers verify (the metrics Service's). */}}
{{- define "rdma-device-plugin.metricsServerName" -}}
{{- printf "%s-metrics.%s.svc" (include "rdma-device-plugin.fullname" .) (include "rdma-device-plugin.namespace" .) }}
{{- end }}

{{- define "rdma-device-plugin.metricsAuthArgs" -}}
{{- if include "rdma-device-plugin.metricsAuth" . }}
# HTTPS, and a bearer token reviewed by the API server (TokenReview, SubjectAccessReview of get /metrics).
- --metrics-auth
- kubernetes
- --metrics-tls-cert
- /etc/rdma-device-plugin-metrics-tls/tls.crt
- --metrics-tls-key
- /etc/rdma-device-plugin-metrics-tls/tls.key
{{- end }}
{{- end }}

{{- define "rdma-device-plugin.metricsAuthMount" -}}
{{- if include "rdma-device-plugin.metricsAuth" . }}
# The metrics serving certificate (read; re-read when the Secret is renewed).
- name: metrics-tls
  mountPath: /etc/rdma-device-plugin-metrics-tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "rdma-device-plugin.metricsAuthVolume" -}}
{{- if include "rdma-device-plugin.metricsAuth" . }}
- name: metrics-tls
  secret:
    secretName: {{ include "rdma-device-plugin.metricsTlsSecret" . }}
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- end }}
