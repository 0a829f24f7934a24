// Env, volumes and exec probes of the process runtime (runtime.go).
package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubecontainer "k8s.io/kubernetes/pkg/kubelet/container"
	"k8s.io/kubernetes/third_party/forked/golang/expansion"
)

// containerEnv resolves a container's env as the kubelet does for what a process needs: literal
// values with $(VAR) references to earlier variables, the downward API's pod fields, and keys of
// ConfigMaps and Secrets (envFrom included).
func (a *nodeAgent) containerEnv(ctx context.Context, pod *v1.Pod, c *v1.Container, podIP string) ([]kubecontainer.EnvVar, error) {
	var out []kubecontainer.EnvVar
	tmp := map[string]string{}
	for _, ef := range c.EnvFrom {
		var data map[string]string
		switch {
		case ef.ConfigMapRef != nil:
			cm, err := a.client.CoreV1().ConfigMaps(pod.Namespace).Get(ctx, ef.ConfigMapRef.Name, metav1.GetOptions{})
			if err != nil {
				if ef.ConfigMapRef.Optional != nil && *ef.ConfigMapRef.Optional {
					continue
				}
				return nil, fmt.Errorf("container %s: envFrom configMap %s: %v", c.Name, ef.ConfigMapRef.Name, err)
			}
			data = cm.Data
		case ef.SecretRef != nil:
			sec, err := a.client.CoreV1().Secrets(pod.Namespace).Get(ctx, ef.SecretRef.Name, metav1.GetOptions{})
			if err != nil {
				if ef.SecretRef.Optional != nil && *ef.SecretRef.Optional {
					continue
				}
				return nil, fmt.Errorf("container %s: envFrom secret %s: %v", c.Name, ef.SecretRef.Name, err)
			}
			data = map[string]string{}
			for k, v := range sec.Data {
				data[k] = string(v)
			}
		}
		keys := make([]string, 0, len(data))
		for k := range data {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			tmp[ef.Prefix+k] = data[k]
			out = append(out, kubecontainer.EnvVar{Name: ef.Prefix + k, Value: data[k]})
		}
	}
	mapping := expansion.MappingFuncFor(tmp)
	for _, e := range c.Env {
		v := e.Value
		if e.ValueFrom == nil {
			v = expansion.Expand(e.Value, mapping)
		} else {
			var err error
			v, err = a.envValueFrom(ctx, pod, e, podIP)
			if err != nil {
				return nil, fmt.Errorf("container %s: env %s: %v", c.Name, e.Name, err)
			}
		}
		tmp[e.Name] = v
		out = append(out, kubecontainer.EnvVar{Name: e.Name, Value: v})
	}
	return out, nil
}

func (a *nodeAgent) envValueFrom(ctx context.Context, pod *v1.Pod, e v1.EnvVar, podIP string) (string, error) {
	f := e.ValueFrom
	switch {
	case f.FieldRef != nil:
		switch f.FieldRef.FieldPath {
		case "metadata.name":
			return pod.Name, nil
		case "metadata.namespace":
			return pod.Namespace, nil
		case "metadata.uid":
			return string(pod.UID), nil
		case "spec.nodeName":
			return pod.Spec.NodeName, nil
		case "spec.serviceAccountName":
			return pod.Spec.ServiceAccountName, nil
		case "status.podIP":
			return podIP, nil
		case "status.podIPs":
			return podIP, nil
		case "status.hostIP", "status.hostIPs":
			return a.cfg.NodeIP, nil
		}
		return "", fmt.Errorf("fieldRef %s is not supported by kubelet-managers", f.FieldRef.FieldPath)
	case f.ConfigMapKeyRef != nil:
		cm, err := a.client.CoreV1().ConfigMaps(pod.Namespace).Get(ctx, f.ConfigMapKeyRef.Name, metav1.GetOptions{})
		if err != nil {
			return "", err
		}
		return cm.Data[f.ConfigMapKeyRef.Key], nil
	case f.SecretKeyRef != nil:
		sec, err := a.client.CoreV1().Secrets(pod.Namespace).Get(ctx, f.SecretKeyRef.Name, metav1.GetOptions{})
		if err != nil {
			return "", err
		}
		return string(sec.Data[f.SecretKeyRef.Key]), nil
	case f.ResourceFieldRef != nil:
		c := a.base[v1.ResourceName(strings.TrimPrefix(strings.TrimPrefix(f.ResourceFieldRef.Resource, "limits."), "requests."))]
		return strconv.FormatInt(c.Value(), 10), nil
	}
	return "", fmt.Errorf("valueFrom of a kind kubelet-managers does not support")
}

// volumeDirs maps each of the container's mountPaths to the host directory (or file) that stands
// for its volume, creating or checking it as the kubelet's volume plugins do.
func (a *nodeAgent) volumeDirs(ctx context.Context, pod *v1.Pod, c *v1.Container, volDir string) (map[string]string, error) {
	vols := map[string]v1.Volume{}
	for _, v := range pod.Spec.Volumes {
		vols[v.Name] = v
	}
	out := map[string]string{}
	for _, m := range c.VolumeMounts {
		v, ok := vols[m.Name]
		if !ok {
			return nil, fmt.Errorf("volumeMount %s: no volume of that name", m.Name)
		}
		dir, err := a.volumeDir(ctx, pod, v, volDir)
		if err != nil {
			return nil, fmt.Errorf("MountVolume.SetUp failed for volume %q: %v", v.Name, err)
		}
		if m.SubPath != "" {
			dir = filepath.Join(dir, m.SubPath)
		}
		out[filepath.Clean(m.MountPath)] = dir
	}
	return out, nil
}

func (a *nodeAgent) volumeDir(ctx context.Context, pod *v1.Pod, v v1.Volume, volDir string) (string, error) {
	own := filepath.Join(volDir, v.Name)
	write := func(data map[string][]byte, items []v1.KeyToPath) (string, error) {
		if err := os.MkdirAll(own, 0o750); err != nil {
			return "", err
		}
		if len(items) > 0 {
			sel := map[string][]byte{}
			for _, it := range items {
				if b, ok := data[it.Key]; ok {
					sel[it.Path] = b
				}
			}
			data = sel
		}
		for k, b := range data {
			p := filepath.Join(own, k)
			if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
				return "", err
			}
			if err := os.WriteFile(p, b, 0o640); err != nil {
				return "", err
			}
		}
		return own, nil
	}
	switch {
	case v.HostPath != nil:
		p := filepath.Join(a.cfg.HostRoot, v.HostPath.Path)
		t := v1.HostPathUnset
		if v.HostPath.Type != nil {
			t = *v.HostPath.Type
		}
		st, err := os.Stat(p)
		switch t {
		case v1.HostPathDirectoryOrCreate:
			if err != nil {
				return p, os.MkdirAll(p, 0o755)
			}
		case v1.HostPathDirectory:
			if err != nil || !st.IsDir() {
				return "", fmt.Errorf("hostPath type check failed: %s is not a directory", v.HostPath.Path)
			}
		case v1.HostPathFile:
			if err != nil || st.IsDir() {
				return "", fmt.Errorf("hostPath type check failed: %s is not a file", v.HostPath.Path)
			}
		case v1.HostPathFileOrCreate:
			if err != nil {
				if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
					return "", err
				}
				return p, os.WriteFile(p, nil, 0o644)
			}
		}
		return p, nil
	case v.ConfigMap != nil:
		cm, err := a.client.CoreV1().ConfigMaps(pod.Namespace).Get(ctx, v.ConfigMap.Name, metav1.GetOptions{})
		if err != nil {
			if v.ConfigMap.Optional != nil && *v.ConfigMap.Optional {
				return write(nil, nil)
			}
			return "", fmt.Errorf("configmap %q not found", v.ConfigMap.Name)
		}
		data := map[string][]byte{}
		for k, s := range cm.Data {
			data[k] = []byte(s)
		}
		for k, b := range cm.BinaryData {
			data[k] = b
		}
		return write(data, v.ConfigMap.Items)
	case v.Secret != nil:
		sec, err := a.client.CoreV1().Secrets(pod.Namespace).Get(ctx, v.Secret.SecretName, metav1.GetOptions{})
		if err != nil {
			if v.Secret.Optional != nil && *v.Secret.Optional {
				return write(nil, nil)
			}
			return "", fmt.Errorf("secret %q not found", v.Secret.SecretName)
		}
		return write(sec.Data, v.Secret.Items)
	default: // emptyDir, and what this runtime does not fill (projected, downwardAPI): an empty dir
		return write(nil, nil)
	}
}

// rewriter maps a container path (an argument or env value, "--flag=PATH" included) to its host
// path: the longest mountPath that is the value or a parent of it wins. A directory with mounts
// below it (the chart's --sysfs-root /host/sys over /host/sys/class, /host/sys/devices, ...) maps
// to the host directory they all share, when they share one (each mount's host path is that
// directory plus the same relative path).
func rewriter(mounts map[string]string) func(string) string {
	keys := make([]string, 0, len(mounts))
	for k := range mounts {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return len(keys[i]) > len(keys[j]) })
	one := func(s string) string {
		for _, k := range keys {
			if s == k || strings.HasPrefix(s, k+"/") {
				return mounts[k] + strings.TrimPrefix(s, k)
			}
		}
		parent, shared := strings.TrimSuffix(s, "/"), ""
		if parent == "" || !strings.HasPrefix(parent, "/") {
			return s
		}
		for _, k := range keys {
			if !strings.HasPrefix(k, parent+"/") {
				continue
			}
			rel := strings.TrimPrefix(k, parent)
			if !strings.HasSuffix(mounts[k], rel) {
				return s
			}
			base := strings.TrimSuffix(mounts[k], rel)
			if shared != "" && shared != base {
				return s
			}
			shared = base
		}
		if shared != "" {
			return shared
		}
		return s
	}
	return func(s string) string {
		if i := strings.Index(s, "="); i > 0 && strings.HasPrefix(s[i+1:], "/") {
			return s[:i+1] + one(s[i+1:])
		}
		return one(s)
	}
}

// ---------------------------------------------------------------- exec probes

// startProbes runs the container's exec readiness and liveness probes with the kubelet's timing
// fields (initialDelaySeconds, periodSeconds, timeoutSeconds, success/failureThreshold) inside the
// container's mount namespace.
func (rt *podRuntime) startProbes(a *nodeAgent, pod *v1.Pod, c *v1.Container, cs *ctrState, environ []string, rw func(string) string) {
	stop := make(chan struct{})
	cs.probeStop = stop
	if c.ReadinessProbe != nil && c.ReadinessProbe.Exec != nil {
		cs.ready, cs.probed = false, true
		go rt.probeLoop(c.ReadinessProbe, cs, environ, rw, stop, func(ok bool) {
			rt.mu.Lock()
			changed := cs.ready != ok && cs.running
			if cs.running {
				cs.ready = ok
			}
			rt.mu.Unlock()
			if changed {
				rt.enqueue()
			}
		})
	}
	if c.LivenessProbe != nil && c.LivenessProbe.Exec != nil {
		go rt.probeLoop(c.LivenessProbe, cs, environ, rw, stop, func(ok bool) {
			if ok {
				return
			}
			rt.mu.Lock()
			p := cs.cmd
			running := cs.running
			rt.mu.Unlock()
			if running && p != nil {
				a.recorder.Eventf(pod, v1.EventTypeWarning, "Unhealthy", "Liveness probe failed: container %s will be restarted", c.Name)
				_ = syscallKillGroup(p)
			}
		})
	}
}

func (rt *podRuntime) probeLoop(pr *v1.Probe, cs *ctrState, environ []string, rw func(string) string, stop chan struct{}, report func(bool)) {
	period := time.Duration(max(pr.PeriodSeconds, 1)) * time.Second
	timeout := time.Duration(max(pr.TimeoutSeconds, 1)) * time.Second
	succ, fail := int(max(pr.SuccessThreshold, 1)), int(max(pr.FailureThreshold, 1))
	select {
	case <-stop:
		return
	case <-time.After(time.Duration(pr.InitialDelaySeconds) * time.Second):
	}
	okRun, badRun := 0, 0
	for {
		rt.mu.Lock()
		pid := cs.pid
		rt.mu.Unlock()
		argv := make([]string, len(pr.Exec.Command))
		for i, s := range pr.Exec.Command {
			argv[i] = rw(s)
		}
		ok := runProbe(pid, argv, environ, timeout)
		if ok {
			okRun, badRun = okRun+1, 0
			if okRun >= succ {
				report(true)
			}
		} else {
			okRun, badRun = 0, badRun+1
			if badRun >= fail {
				report(false)
			}
		}
		select {
		case <-stop:
			return
		case <-time.After(period):
		}
	}
}

func runProbe(pid int, argv, environ []string, timeout time.Duration) bool {
	if len(argv) == 0 {
		return false
	}
	if privateMounts() && pid > 0 {
		argv = append([]string{"nsenter", fmt.Sprintf("--mount=/proc/%d/ns/mnt", pid), "--"}, argv...)
	}
	path, err := lookPath(argv[0], environ)
	if err != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	p := exec.CommandContext(ctx, path, argv[1:]...)
	p.Env, p.Dir = environ, "/"
	return p.Run() == nil
}
