{{/*
Checks that values.schema.json cannot express (combinations) plus the ranges again (the schema can be
skipped with --skip-schema-validation). Every problem is collected and reported in ONE fail, each
line saying how to fix it. Included at the top of the ConfigMap template, so nothing renders when a
check fails.
*/}}
{{- define "rdma-device-plugin.validate" -}}
{{- $v := .Values }}
{{- $errors := list }}

{{- /* modes */}}
{{- if not (has $v.mode (list "shared" "exclusive")) }}
{{- $errors = append $errors (printf "mode=%v: use shared or exclusive" $v.mode) }}
{{- end }}

{{- /* the API that serves the NICs (driver: dra needs DRA with consumable capacity, counters, device taints and extended-resource classes) */}}
{{- if not (has $v.driver (list "devicePlugin" "dra")) }}
{{- $errors = append $errors (printf "driver=%v: use devicePlugin or dra" $v.driver) }}
{{- end }}
{{- /* the floor is what is tested (v1.37.2): 1.36 lacks scheduler and kubelet fixes the driver relies on
(the driver's dra/version.py and the collection's rdma_dra_preflight hold the same floor) */}}
{{- if and (include "rdma-device-plugin.draEnabled" .) (semverCompare "<1.37.0-0" .Capabilities.KubeVersion.Version) }}
{{- $errors = append $errors (printf "driver=%v, dra.enabled=%v: the DRA driver needs Kubernetes 1.37 or later (tested on v1.37.2), this cluster is %s: 1.36's scheduler and kubelet lack fixes it relies on (kubernetes#138882, #139034, the v1 health API; docs/dra.md, Supported versions); upgrade the cluster to 1.37, or set driver=devicePlugin and dra.enabled=false (helm template: --kube-version of the real cluster)" $v.driver $v.dra.enabled .Capabilities.KubeVersion.Version) }}
{{- else if and (include "rdma-device-plugin.draEnabled" .) (not (include "rdma-device-plugin.hasAPI" (dict "root" . "api" "resource.k8s.io/v1/DeviceClass" "minKube" "1.37.0-0"))) }}
{{- $errors = append $errors (printf "driver=dra (or dra.enabled) needs resource.k8s.io/v1 with consumable capacity and extended-resource DeviceClasses, which this cluster (%s) does not serve; keep driver=devicePlugin and dra.enabled=false, or render with --kube-version/--api-versions of the real cluster (docs/dra.md)" .Capabilities.KubeVersion.Version) }}
{{- end }}
{{- /* the DRA ClusterRole is bound to the chart's ServiceAccount: never to the namespace's default one,
whose token every pod of the namespace gets */}}
{{- if and (include "rdma-device-plugin.draEnabled" .) (not $v.serviceAccount.create) (not $v.serviceAccount.name) }}
{{- $errors = append $errors (printf "serviceAccount.create=false without serviceAccount.name: the DRA driver's ClusterRole (ResourceSlices write) would be bound to %s:default, which every pod of the namespace runs as; set serviceAccount.name to a ServiceAccount only the driver uses, or serviceAccount.create=true" (include "rdma-device-plugin.namespace" .)) }}
{{- else if and (include "rdma-device-plugin.draEnabled" .) (eq (toString $v.serviceAccount.name) "default") }}
{{- $errors = append $errors (printf "serviceAccount.name=default: the DRA driver's ClusterRole (ResourceSlices write) would be bound to %s:default, which every pod of the namespace runs as; name a ServiceAccount only the driver uses" (include "rdma-device-plugin.namespace" .)) }}
{{- end }}

{{- /* the node labels that steer the DaemonSets: only under node-restriction.kubernetes.io/, which the
NodeRestriction admission plugin refuses a kubelet on its own Node (a compromised node could otherwise
label itself validated, or pick its own mode or API) */}}
{{- range $where, $key := dict "modeLabelKey" $v.modeLabelKey "driverLabelKey" $v.driverLabelKey "validation.labelKey" ($v.validation | default dict).labelKey }}
{{- if not (regexMatch "^([^/]+[.])?node-restriction[.]kubernetes[.]io/" (toString $key)) }}
{{- $errors = append $errors (printf "%s=%v: a kubelet can set this label on its own Node; use a key under node-restriction.kubernetes.io/ (the default node-restriction.kubernetes.io/rdma-%s), which NodeRestriction refuses it (docs/security.md)" $where $key (get (dict "modeLabelKey" "mode" "driverLabelKey" "driver" "validation.labelKey" "validated") $where)) }}
{{- end }}
{{- end }}

{{- /* resource pools: names unique across resourceName and extraResources, sharedDevices in range */}}
{{- $seen := dict }}
{{- $pools := list (dict "where" "resourceName/sharedDevices" "name" $v.resourceName "sharedDevices" $v.sharedDevices) }}
{{- range $i, $r := $v.extraResources }}
{{- $pools = append $pools (dict "where" (printf "extraResources[%d]" $i) "name" ($r.name | default "") "sharedDevices" (ternary $r.sharedDevices 1000 (hasKey $r "sharedDevices"))) }}
{{- end }}
{{- range $pools }}
{{- $name := toString .name }}
{{- if hasKey $seen $name }}
{{- $errors = append $errors (printf "%s: resource name %q is already used by %s; give every pool its own name (resourceName and extraResources[].name must all differ)" .where $name (get $seen $name)) }}
{{- else }}
{{- $_ := set $seen $name .where }}
{{- end }}
{{- if contains "kubernetes.io" $name }}
{{- $errors = append $errors (printf "%s: resource name %q uses the reserved kubernetes.io domain; pick your own domain, e.g. rdma/hca" .where $name) }}
{{- end }}
{{- $n := .sharedDevices | float64 }}
{{- if or (lt $n 1.0) (gt $n 100000.0) (ne $n (floor $n)) }}
{{- $errors = append $errors (printf "%s: sharedDevices=%v is out of range; use a whole number from 1 to 100000 (1000 is what ACK uses)" .where .sharedDevices) }}
{{- end }}
{{- end }}

{{- /* admission policy */}}
{{- $actions := $v.admissionPolicy.validationActions | default list }}
{{- if and $v.admissionPolicy.enabled (has "Deny" $actions) (has "Warn" $actions) }}
{{- $errors = append $errors "admissionPolicy.validationActions: Deny and Warn together are rejected by Kubernetes (they duplicate the failure in the response and in warnings); use [Deny] or [Deny, Audit] to block, or [Warn] / [Warn, Audit] to only warn" }}
{{- end }}
{{- if and $v.admissionPolicy.enabled (not $actions) }}
{{- $errors = append $errors "admissionPolicy.validationActions is empty; list at least one of Deny, Warn, Audit, or set admissionPolicy.enabled=false" }}
{{- end }}
{{- if ne (len $actions) (len (uniq $actions)) }}
{{- $errors = append $errors (printf "admissionPolicy.validationActions=%v lists an action twice; list each action once" $actions) }}
{{- end }}

{{- /* APIs the optional objects need, as the cluster (or helm template --api-versions / --kube-version) reports them */}}
{{- if and $v.admissionPolicy.enabled (not (include "rdma-device-plugin.hasAPI" (dict "root" . "api" "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" "minKube" "1.30.0-0"))) }}
{{- $errors = append $errors (printf "admissionPolicy.enabled=true needs admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy (Kubernetes >= 1.30), which this cluster (%s) does not serve; set admissionPolicy.enabled=false (RDMA pods are then not checked for IPC_LOCK/hostNetwork), or render with --kube-version/--api-versions of the real cluster" .Capabilities.KubeVersion.Version) }}
{{- end }}
{{- if and $v.metrics.enabled $v.metrics.serviceMonitor.enabled (not (include "rdma-device-plugin.hasAPI" (dict "root" . "api" "monitoring.coreos.com/v1"))) }}
{{- $errors = append $errors (printf "metrics.serviceMonitor.enabled=true needs the prometheus-operator API monitoring.coreos.com/v1 (for its %s), which this cluster does not serve; install prometheus-operator first, set metrics.serviceMonitor.enabled=false, or with helm template pass --api-versions monitoring.coreos.com/v1" $v.metrics.serviceMonitor.kind) }}
{{- end }}
{{- if and $v.metrics.prometheusRule.enabled (not (include "rdma-device-plugin.hasAPI" (dict "root" . "api" "monitoring.coreos.com/v1"))) }}
{{- $errors = append $errors "metrics.prometheusRule.enabled=true needs the prometheus-operator API monitoring.coreos.com/v1, which this cluster does not serve; install prometheus-operator first, set metrics.prometheusRule.enabled=false, or with helm template pass --api-versions monitoring.coreos.com/v1" }}
{{- end }}
{{- if and (not $v.metrics.auth.enabled) (or $v.metrics.auth.readers $v.metrics.auth.tlsSecretName) }}
{{- $errors = append $errors "metrics.auth.readers or metrics.auth.tlsSecretName is set but metrics.auth.enabled=false serves the metrics in plain HTTP to anyone; set metrics.auth.enabled=true, or drop them" }}
{{- end }}
{{- if $v.metrics.networkPolicy.enabled }}
{{- if not $v.metrics.enabled }}
{{- $errors = append $errors "metrics.networkPolicy.enabled=true needs metrics.enabled=true (it guards the metrics port); set both" }}
{{- else if or $v.hostNetwork $v.nonHostNetwork.enabled }}
{{- $errors = append $errors "metrics.networkPolicy.enabled=true: the plugin pods use hostNetwork (hostNetwork or nonHostNetwork.enabled), and NetworkPolicy does not apply to host-network pods; set metrics.networkPolicy.enabled=false and guard the node's metrics port another way (docs/security.md)" }}
{{- else if not $v.metrics.networkPolicy.from }}
{{- $errors = append $errors "metrics.networkPolicy.from is empty, so nothing could scrape the metrics; list the peers of your Prometheus, e.g. [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}}]" }}
{{- end }}
{{- end }}
{{- range $name := list "prometheusRule" "dashboard" }}
{{- if and (index $v.metrics $name "enabled") (not $v.metrics.enabled) }}
{{- $errors = append $errors (printf "metrics.%s.enabled=true needs metrics.enabled=true (its alerts/panels read the plugin's metrics); set both" $name) }}
{{- end }}
{{- end }}

{{- /* labels the chart owns (selectors, release bookkeeping) */}}
{{- $reserved := include "rdma-device-plugin.reservedLabels" . | fromJsonArray }}
{{- range $key, $labels := dict "podLabels" $v.podLabels "commonLabels" $v.commonLabels }}
{{- range $name, $_ := $labels }}
{{- if has $name $reserved }}
{{- $errors = append $errors (printf "%s.%s: the chart sets this label itself (selectors and release bookkeeping depend on it); use another key" $key $name) }}
{{- end }}
{{- end }}
{{- end }}

{{- /* helm test pod: it must not land on a cordoned or tainted-for-eviction node */}}
{{- range $i, $t := $v.test.tolerations }}
{{- if and (not $t.key) (eq (toString $t.operator) "Exists") }}
{{- $errors = append $errors (printf "test.tolerations[%d] tolerates every taint (operator Exists without a key), so the test pod could land on a node the mode switch just cordoned; name the taint key, e.g. node-role.alibabacloud.com/lingjun" $i) }}
{{- else if has (toString $t.key) (list "node.kubernetes.io/unschedulable" "node.kubernetes.io/not-ready" "node.kubernetes.io/unreachable") }}
{{- $errors = append $errors (printf "test.tolerations[%d] tolerates %s, so the test pod could land on a cordoned or failing node; drop it" $i $t.key) }}
{{- end }}
{{- end }}

{{- /* metrics */}}
{{- if and $v.metrics.serviceMonitor.enabled (not $v.metrics.enabled) }}
{{- $errors = append $errors "metrics.serviceMonitor.enabled=true needs metrics.enabled=true (there is nothing to scrape otherwise); set metrics.enabled=true or metrics.serviceMonitor.enabled=false" }}
{{- end }}
{{- $port := $v.metrics.port | float64 }}
{{- if or (lt $port 1.0) (gt $port 65535.0) }}
{{- $errors = append $errors (printf "metrics.port=%v: use a port from 1 to 65535" $v.metrics.port) }}
{{- end }}

{{- /* security context */}}
{{- $sc := $v.securityContext | default dict }}
{{- if and $v.privileged (hasKey $sc "allowPrivilegeEscalation") (not $sc.allowPrivilegeEscalation) }}
{{- $errors = append $errors "privileged=true with securityContext.allowPrivilegeEscalation=false is rejected by Kubernetes; drop securityContext.allowPrivilegeEscalation or (better) set privileged=false, the plugin does not need it" }}
{{- end }}
{{- if and (hasKey $sc "privileged") (ne (toString $sc.privileged) (toString $v.privileged)) }}
{{- $errors = append $errors "securityContext.privileged contradicts the privileged value; set privileged (top level) only" }}
{{- end }}
{{- if and (hasKey $sc "runAsNonRoot") $sc.runAsNonRoot }}
{{- $errors = append $errors "securityContext.runAsNonRoot=true cannot work: the plugin must run as root to create its socket in the kubelet's root-owned device-plugins directory; remove it" }}
{{- end }}

{{- /* image: bitnami's global.imageRegistry cannot apply to a repository that names its own host */}}
{{- if and ((.Values.global | default dict).imageRegistry) (include "rdma-device-plugin.repositoryHasHost" .) }}
{{- $errors = append $errors (printf "global.imageRegistry=%s cannot apply: image.repository=%s starts with a registry host, which would render %s/%s; set image.repository to the path alone (e.g. rdma/rdma-device-plugin) and the host in image.registry (bitnami convention)" .Values.global.imageRegistry $v.image.repository .Values.global.imageRegistry $v.image.repository) }}
{{- end }}

{{- /* rolling update: Kubernetes rejects a DaemonSet whose maxUnavailable and maxSurge are both 0 */}}
{{- $ru := ($v.updateStrategy | default dict).rollingUpdate | default dict }}
{{- if and (eq ($v.updateStrategy | default dict).type "RollingUpdate") (hasKey $ru "maxUnavailable") (has (toString $ru.maxUnavailable) (list "0" "0%")) (has (toString ($ru.maxSurge | default 0)) (list "0" "0%")) }}
{{- $errors = append $errors "updateStrategy.rollingUpdate.maxUnavailable is 0 and maxSurge is 0: the rollout could never start (Kubernetes rejects it); use a count or a percentage such as 10%" }}
{{- end }}
{{- /* a surge pod runs next to the old one on the same node: with hostNetwork both bind <node IP>:<metrics.port>,
the new one fails (Address already in use, exit 2) and the rollout never completes */}}
{{- if and (eq ($v.updateStrategy | default dict).type "RollingUpdate") (or $v.hostNetwork $v.nonHostNetwork.enabled) $v.metrics.enabled (not (has (toString ($ru.maxSurge | default 0)) (list "0" "0%"))) }}
{{- $errors = append $errors (printf "updateStrategy.rollingUpdate.maxSurge=%v with hostNetwork (hostNetwork=%v, nonHostNetwork.enabled=%v) and metrics.enabled: the surge pod binds the same <node IP>:%v as the running plugin and exits (Address already in use), so the rollout never completes; set maxSurge: 0 and roll with maxUnavailable (e.g. 10%%), or run the plugin in the pod network (hostNetwork=false, nonHostNetwork.enabled=false: metrics bind the pod IP)" $ru.maxSurge $v.hostNetwork $v.nonHostNetwork.enabled $v.metrics.port) }}
{{- end }}

{{- /* image and config versions: the config carries pluginVersion = appVersion and keys that plugin knows;
an older image refuses it (or, before 0.2.0, crash-loops on "unknown key"). A tag that is a version is
checked here; any other tag (dev, latest) is checked by the plugin at start. */}}
{{- $tag := trimPrefix "v" (toString $v.image.tag) }}
{{- $appMM := regexFind "^[0-9]+\\.[0-9]+" .Chart.AppVersion }}
{{- $tagMM := regexFind "^[0-9]+\\.[0-9]+" $tag }}
{{- if and $tagMM (regexMatch "^[0-9]+\\.[0-9]+\\.[0-9]+" $tag) (semverCompare (printf "<%s.0-0" $appMM) (printf "%s.0" $tagMM)) }}
{{- $errors = append $errors (printf "image.tag=%s is older than the plugin this chart is made for (appVersion %s: its config has pluginVersion %s and keys a %s.x plugin does not know, which would refuse it or crash-loop); leave image.tag empty (the appVersion), use a %s.x or newer image, or install the chart release whose appVersion is %s.x" $v.image.tag .Chart.AppVersion .Chart.AppVersion $tagMM $appMM $tagMM) }}
{{- end }}

{{- /* CDI: Allocate then answers with CDI names only; the runtime must apply them or pods get no devices */}}
{{- if $v.cdi.enabled }}
{{- if semverCompare "<1.28.0-0" .Capabilities.KubeVersion.Version }}
{{- $errors = append $errors (printf "cdi.enabled=true needs Kubernetes >= 1.28 (the kubelet passes a device plugin's CDI devices to the runtime from 1.28, feature gate DevicePluginCDIDevices, on by default from 1.29); this cluster is %s: set cdi.enabled=false" .Capabilities.KubeVersion.Version) }}
{{- else if not $v.cdi.runtimeEnabled }}
{{- $errors = append $errors "cdi.enabled=true makes the plugin answer Allocate with CDI device names only, so pods get no RDMA devices unless every node's runtime applies CDI: containerd 1.7 needs enable_cdi = true (and cdi_spec_dirs with cdi.hostDir) in its CRI plugin config (containerd 2.0 and CRI-O have it on), and the kubelet needs the feature gate DevicePluginCDIDevices (on by default from 1.29). Set cdi.runtimeEnabled=true once they are, or cdi.enabled=false" }}
{{- end }}
{{- end }}

{{- /* paths */}}
{{- range $key, $path := dict "kubeletDir" $v.kubeletDir "cdi.hostDir" $v.cdi.hostDir "sysfsHostPath" $v.sysfsHostPath }}
{{- if not (hasPrefix "/" (toString $path)) }}
{{- $errors = append $errors (printf "%s=%q must be an absolute path on the node, e.g. /var/lib/kubelet" $key (toString $path)) }}
{{- end }}
{{- end }}

{{- if $errors }}
{{- fail (printf "\n\nrdma-device-plugin: %d problem(s) in the values; fix each and render again:\n  - %s\n" (len $errors) (join "\n  - " $errors)) }}
{{- end }}
{{- end }}
