// The containers of a joined node: a process "runtime" with no images.
//
// A container whose image's name (the last path element, without tag or digest) is a key of
// join.images runs as a host process: the image's entrypoint from that entry (or the container's
// command), the container's args, its env (values, $(VAR) references, fieldRef, configMapKeyRef,
// secretKeyRef) and $(VAR) expansion by the kubelet's own ExpandContainerCommandAndArgs. Volume
// mounts are mapped, not mounted: every argument or env value that is a mountPath or below one is
// rewritten to the volume's host directory (hostPath P -> join.host_root + P, checked against its
// type as the kubelet's volume plugin checks it; configMap, secret and emptyDir volumes are
// materialized in the state dir). As root, each process gets a mount namespace of its own with a
// private /dev/shm (a container's /dev/shm is its own), and exec probes run inside it (nsenter), as
// `runc exec` does. A command that does not exist is a CreateContainerError, retried every second
// (a runtime would fail the start; here an image's entrypoint may appear later, as an image is
// pulled). Other containers count as running and ready from the start and never exit.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubecontainer "k8s.io/kubernetes/pkg/kubelet/container"
)

// imageRuntime says how to run the containers of one image on this machine.
type imageRuntime struct {
	Entrypoint []string `json:"entrypoint"` // the image's ENTRYPOINT
	Path       []string `json:"path"`       // directories put first on PATH (the image's PATH)
}

const (
	backoffInitial = time.Second
	backoffMax     = 30 * time.Second
)

// ctrState is one container's runtime state.
type ctrState struct {
	name      string
	init      bool
	sidecar   bool // an init container with restartPolicy Always
	image     *imageRuntime
	cmd       *exec.Cmd
	pid       int
	running   bool
	started   bool // ever started (a completed unmapped init container counts)
	exitCode  int
	exitMsg   string
	startedAt time.Time
	endedAt   time.Time
	restarts  int
	nextStart time.Time
	ready     bool // readiness probe result (true without a probe)
	probed    bool // a readiness probe runs for it
	probeStop chan struct{}
	logPath   string
	waiting   string // reason while not running (CreateContainerError, CrashLoopBackOff, ...)
	waitMsg   string
}

// podRuntime is one pod's runtime state; it outlives a kubelet restart (it lives in the server).
type podRuntime struct {
	mu         sync.Mutex
	key        string
	uid        types.UID
	prepared   bool
	prepareErr string
	runOpts    map[string]obj
	ctrs       map[string]*ctrState
	order      []string
	startTime  time.Time
	podIP      string
	volDir     string
	enqueue    func()
	pod        *v1.Pod // the last pod object synced: a pod gone from the API is still unprepared with it
}

func (s *server) runtimeKeys() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.runtimes))
	for k := range s.runtimes {
		out = append(out, k)
	}
	return out
}

func (s *server) runtimeUIDs(key string) []types.UID {
	s.mu.Lock()
	defer s.mu.Unlock()
	if rt, ok := s.runtimes[key]; ok {
		return []types.UID{rt.uid}
	}
	return nil
}

// peekRuntime is takeRuntime without removing it (teardown removes it once the claims are unprepared).
func (s *server) peekRuntime(key string, uid types.UID) *podRuntime {
	s.mu.Lock()
	defer s.mu.Unlock()
	if rt, ok := s.runtimes[key]; ok && rt.uid == uid {
		return rt
	}
	return nil
}

func (s *server) takeRuntime(key string, uid types.UID) *podRuntime {
	s.mu.Lock()
	defer s.mu.Unlock()
	rt, ok := s.runtimes[key]
	if !ok || rt.uid != uid {
		return nil
	}
	delete(s.runtimes, key)
	return rt
}

// forgetPod: the pod is no longer active (the kubelet's GetActivePods leaves out terminated pods).
func (s *server) forgetPod(uid types.UID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.pods, uid)
}

// runtimeFor returns the pod's runtime state, created at the first sync after admission.
func (s *server) runtimeFor(a *nodeAgent, key string, pod *v1.Pod) *podRuntime {
	s.mu.Lock()
	defer s.mu.Unlock()
	if rt, ok := s.runtimes[key]; ok && rt.uid == pod.UID {
		rt.mu.Lock()
		rt.pod = pod
		rt.mu.Unlock()
		return rt
	}
	s.podSeq++
	rt := &podRuntime{key: key, uid: pod.UID, pod: pod, runOpts: map[string]obj{}, ctrs: map[string]*ctrState{},
		startTime: time.Now(), volDir: filepath.Join(a.cfg.StateDir, "pods", string(pod.UID), "volumes")}
	rt.podIP = a.cfg.NodeIP
	if !pod.Spec.HostNetwork {
		rt.podIP = podIP(a.cfg.NodeIP, s.podSeq)
	}
	q := a.queue
	rt.enqueue = func() { q.Add(key) }
	for _, c := range pod.Spec.InitContainers {
		cs := &ctrState{name: c.Name, init: true, ready: true}
		cs.sidecar = c.RestartPolicy != nil && *c.RestartPolicy == v1.ContainerRestartPolicyAlways
		rt.ctrs[c.Name], rt.order = cs, append(rt.order, c.Name)
	}
	for _, c := range pod.Spec.Containers {
		rt.ctrs[c.Name], rt.order = &ctrState{name: c.Name, ready: true}, append(rt.order, c.Name)
	}
	for _, cs := range rt.ctrs {
		c := containerByName(pod, cs.name)
		if ir, ok := a.cfg.Images[imageName(c.Image)]; ok {
			ir := ir
			cs.image = &ir
			cs.logPath = filepath.Join(a.cfg.RecordDir, "logs", pod.Namespace+"_"+pod.Name+"_"+c.Name+".log")
		}
	}
	s.runtimes[key] = rt
	return rt
}

// podIP: 127.A.B.n for the n-th pod of a node whose IP is 127.A.B.x (every 127/8 address is the
// loopback interface's), so two pods binding one port on different "nodes" do not collide.
func podIP(nodeIP string, n int) string {
	p := strings.Split(nodeIP, ".")
	return fmt.Sprintf("127.%s.%s.%d", p[1], p[2], 100+n%150)
}

// imageName: "registry:5000/a/rdma-device-plugin:0.2.0@sha256:..." -> "rdma-device-plugin".
func imageName(image string) string {
	if i := strings.Index(image, "@"); i >= 0 {
		image = image[:i]
	}
	if i := strings.LastIndex(image, ":"); i > strings.LastIndex(image, "/") {
		image = image[:i]
	}
	return image[strings.LastIndex(image, "/")+1:]
}

func containerByName(pod *v1.Pod, name string) *v1.Container {
	for _, c := range allContainers(pod) {
		if c.Name == name {
			return c
		}
	}
	return nil
}

func (rt *podRuntime) setPrepareError(err error) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	rt.prepareErr = err.Error()
}

func (rt *podRuntime) setPrepared() {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	rt.prepared, rt.prepareErr = true, ""
}

func (rt *podRuntime) isPrepared() bool {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return rt.prepared
}

func (rt *podRuntime) setRunOptions(ctr string, o obj) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	rt.runOpts[ctr] = o
}

// record: what the pod's containers got, written to record_dir/<namespace>_<name>.json.
func (rt *podRuntime) record(pod *v1.Pod) obj {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	ctrs := obj{}
	for k, v := range rt.runOpts {
		ctrs[k] = v
	}
	out := obj{"uid": string(pod.UID), "name": pod.Name, "namespace": pod.Namespace, "node": pod.Spec.NodeName,
		"prepared": rt.prepared, "containers": ctrs}
	if rt.prepareErr != "" {
		out["prepare_error"] = rt.prepareErr
	}
	return out
}

// advance starts what is due (init containers in order, then the others; restarts after back-off)
// and returns when to look again.
func (rt *podRuntime) advance(ctx context.Context, a *nodeAgent, pod *v1.Pod) time.Duration {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	now := time.Now()
	var next time.Duration
	due := func(t time.Time) {
		if d := t.Sub(now); d > 0 && (next == 0 || d < next) {
			next = d
		}
	}
	startOrRestart := func(cs *ctrState) bool {
		c := containerByName(pod, cs.name)
		if cs.running {
			return true
		}
		if cs.started && !rt.mayRestart(pod, cs) {
			return false
		}
		if cs.nextStart.After(now) {
			due(cs.nextStart)
			return false
		}
		if cs.started {
			cs.restarts++
		}
		if err := rt.start(ctx, a, pod, c, cs); err != nil {
			cs.waiting, cs.waitMsg = "CreateContainerError", err.Error()
			cs.nextStart = now.Add(backoff(cs.restarts))
			due(cs.nextStart)
			a.recorder.Eventf(pod, v1.EventTypeWarning, "Failed", "Error: %v", err)
			return false
		}
		return true
	}
	for _, name := range rt.order {
		cs := rt.ctrs[name]
		if !cs.init {
			continue
		}
		if cs.sidecar {
			startOrRestart(cs)
			continue
		}
		if cs.started && !cs.running && cs.exitCode == 0 {
			continue // completed
		}
		startOrRestart(cs)
		return next // the next init container waits for this one
	}
	for _, name := range rt.order {
		if cs := rt.ctrs[name]; !cs.init {
			startOrRestart(cs)
		}
	}
	return next
}

func backoff(restarts int) time.Duration {
	d := backoffInitial << min(restarts, 10)
	return min(d, backoffMax)
}

func (rt *podRuntime) mayRestart(pod *v1.Pod, cs *ctrState) bool {
	if cs.sidecar {
		return true
	}
	switch pod.Spec.RestartPolicy {
	case v1.RestartPolicyNever:
		return false
	case v1.RestartPolicyOnFailure:
		return cs.exitCode != 0
	}
	return true
}

// start runs one container: a process for a mapped image, nothing for the others.
func (rt *podRuntime) start(ctx context.Context, a *nodeAgent, pod *v1.Pod, c *v1.Container, cs *ctrState) error {
	cs.waiting, cs.waitMsg = "", ""
	if cs.image == nil {
		cs.started, cs.running, cs.startedAt = true, !cs.init || cs.sidecar, time.Now()
		if cs.init && !cs.sidecar {
			cs.exitCode, cs.endedAt = 0, time.Now()
		}
		return nil
	}
	env, err := a.containerEnv(ctx, pod, c, rt.podIP)
	if err != nil {
		return err
	}
	mounts, err := a.volumeDirs(ctx, pod, c, rt.volDir)
	if err != nil {
		return err
	}
	rw := rewriter(mounts)
	cmd, args := kubecontainer.ExpandContainerCommandAndArgs(c, env)
	if len(cmd) == 0 {
		cmd = cs.image.Entrypoint
	}
	argv := append(append([]string{}, cmd...), args...)
	if len(argv) == 0 {
		return fmt.Errorf("container %s: no command (the image entry of join.images has no entrypoint)", c.Name)
	}
	for i := range argv {
		argv[i] = rw(argv[i])
	}
	environ := []string{"PATH=" + strings.Join(append(append([]string{}, cs.image.Path...), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"), ":"),
		"HOSTNAME=" + hostname(pod)}
	for _, e := range env {
		environ = append(environ, e.Name+"="+rw(e.Value))
	}
	if err := os.MkdirAll(filepath.Dir(cs.logPath), 0o750); err != nil {
		return err
	}
	logf, err := os.OpenFile(cs.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640)
	if err != nil {
		return err
	}
	defer logf.Close()
	// The container's command is looked up before the mount namespace wraps it: a missing one is a
	// CreateContainerError (retried every second, never running nor ready) whoever runs this, not a
	// shell that exits 127 only when running as root.
	if _, err := lookPath(argv[0], environ); err != nil {
		return fmt.Errorf("container %s: %v", c.Name, err)
	}
	p := exec.Command(argv[0], argv[1:]...)
	if privateMounts() {
		// A mount namespace of its own with a private /dev/shm, then exec the container's command.
		p = exec.Command("unshare", append([]string{"--mount", "--propagation", "private", "--", "/bin/sh", "-c",
			`mount -t tmpfs -o size=64m,mode=1777 shm /dev/shm && exec "$@"`, "sh"}, argv...)...)
	}
	if p.Path, err = lookPath(p.Args[0], environ); err != nil {
		return fmt.Errorf("container %s: %v", c.Name, err)
	}
	p.Env, p.Dir, p.Stdout, p.Stderr = environ, "/", logf, logf
	p.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := p.Start(); err != nil {
		return fmt.Errorf("container %s: %v", c.Name, err)
	}
	cs.cmd, cs.pid, cs.running, cs.started, cs.startedAt = p, p.Process.Pid, true, true, time.Now()
	cs.exitCode, cs.exitMsg = 0, ""
	enqueue := rt.enqueue
	go func() {
		err := p.Wait()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				code = 128 + int(ws.Signal())
			}
		}
		rt.mu.Lock()
		if cs.cmd == p {
			cs.running, cs.exitCode, cs.endedAt, cs.ready = false, code, time.Now(), false
			cs.nextStart = time.Now().Add(backoff(cs.restarts))
			if cs.probeStop != nil {
				close(cs.probeStop)
				cs.probeStop = nil
			}
		}
		rt.mu.Unlock()
		enqueue()
	}()
	rt.startProbes(a, pod, c, cs, environ, rw)
	return nil
}

func hostname(pod *v1.Pod) string {
	if pod.Spec.HostNetwork {
		return pod.Spec.NodeName
	}
	return pod.Name
}

func lookPath(name string, environ []string) (string, error) {
	if strings.Contains(name, "/") {
		if st, err := os.Stat(name); err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
			return "", fmt.Errorf("executable %q not found (join.images[].entrypoint or the container's command)", name)
		}
		return name, nil
	}
	for _, e := range environ {
		if strings.HasPrefix(e, "PATH=") {
			for _, d := range filepath.SplitList(strings.TrimPrefix(e, "PATH=")) {
				if st, err := os.Stat(filepath.Join(d, name)); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
					return filepath.Join(d, name), nil
				}
			}
		}
	}
	return "", fmt.Errorf("executable %q not found in the image's PATH (join.images[].path)", name)
}

var privateMountsOnce = sync.OnceValue(func() bool {
	if os.Geteuid() != 0 {
		return false
	}
	_, err := exec.LookPath("unshare")
	return err == nil
})

func privateMounts() bool { return privateMountsOnce() }

// kill stops every container of the pod: SIGTERM to each process group, SIGKILL after grace.
func (rt *podRuntime) kill(grace time.Duration) {
	rt.mu.Lock()
	var procs []*exec.Cmd
	for _, cs := range rt.ctrs {
		if cs.probeStop != nil {
			close(cs.probeStop)
			cs.probeStop = nil
		}
		if cs.running && cs.cmd != nil {
			procs = append(procs, cs.cmd)
		}
		cs.running = false
	}
	rt.mu.Unlock()
	for _, p := range procs {
		_ = syscall.Kill(-p.Process.Pid, syscall.SIGTERM)
	}
	deadline := time.Now().Add(grace)
	for _, p := range procs {
		for syscall.Kill(p.Process.Pid, 0) == nil && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		_ = syscall.Kill(-p.Process.Pid, syscall.SIGKILL)
	}
}

// ---------------------------------------------------------------- status

func (rt *podRuntime) status(a *nodeAgent, pod *v1.Pod, st *v1.PodStatus) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	now := metav1.Now()
	st.HostIP, st.HostIPs = a.cfg.NodeIP, []v1.HostIP{{IP: a.cfg.NodeIP}}
	st.PodIP, st.PodIPs = rt.podIP, []v1.PodIP{{IP: rt.podIP}}
	if st.StartTime == nil {
		t := metav1.NewTime(rt.startTime)
		st.StartTime = &t
	}
	initDone, allReady, anyRunning, allEnded, allOK := true, true, false, true, true
	var initStatuses, statuses []v1.ContainerStatus
	for _, name := range rt.order {
		cs := rt.ctrs[name]
		c := containerByName(pod, name)
		s := v1.ContainerStatus{Name: name, Image: c.Image, ImageID: c.Image, RestartCount: int32(cs.restarts)}
		switch {
		case cs.running:
			s.State.Running = &v1.ContainerStateRunning{StartedAt: metav1.NewTime(cs.startedAt)}
			s.Ready = cs.ready
			t := true
			s.Started = &t
			if cs.pid > 0 {
				s.ContainerID = fmt.Sprintf("process://%d", cs.pid)
			}
		case cs.started && !cs.endedAt.IsZero() && (cs.waiting == "" || !rt.mayRestart(pod, cs)):
			term := &v1.ContainerStateTerminated{ExitCode: int32(cs.exitCode), StartedAt: metav1.NewTime(cs.startedAt),
				FinishedAt: metav1.NewTime(cs.endedAt), Reason: "Completed"}
			if cs.exitCode != 0 {
				term.Reason = "Error"
			}
			if rt.mayRestart(pod, cs) && cs.nextStart.After(time.Now()) {
				s.State.Waiting = &v1.ContainerStateWaiting{Reason: "CrashLoopBackOff",
					Message: fmt.Sprintf("back-off restarting failed container %s", name)}
				s.LastTerminationState.Terminated = term
			} else {
				s.State.Terminated = term
			}
		default:
			reason := cs.waiting
			if reason == "" {
				reason = "ContainerCreating"
				if !rt.prepared {
					reason = "ContainerCreating"
				}
			}
			s.State.Waiting = &v1.ContainerStateWaiting{Reason: reason, Message: cs.waitMsg}
		}
		if cs.init && !cs.sidecar {
			if !(cs.started && !cs.running && cs.exitCode == 0 && !cs.endedAt.IsZero()) {
				initDone = false
			}
			initStatuses = append(initStatuses, s)
			continue
		}
		if cs.init {
			initStatuses = append(initStatuses, s)
			continue
		}
		if cs.running {
			anyRunning = true
			allEnded = false
		} else if !(cs.started && !cs.endedAt.IsZero()) || rt.mayRestart(pod, cs) {
			allEnded = false
		}
		if cs.started && !cs.running && cs.exitCode != 0 {
			allOK = false
		}
		if !(cs.running && cs.ready) {
			allReady = false
		}
		statuses = append(statuses, s)
	}
	st.InitContainerStatuses, st.ContainerStatuses = initStatuses, statuses
	switch {
	case !initDone:
		st.Phase = v1.PodPending
		for _, s := range initStatuses {
			if s.State.Terminated != nil && s.State.Terminated.ExitCode != 0 && pod.Spec.RestartPolicy == v1.RestartPolicyNever {
				st.Phase = v1.PodFailed
			}
		}
	case allEnded && len(statuses) > 0:
		st.Phase = v1.PodSucceeded
		if !allOK {
			st.Phase = v1.PodFailed
		}
	case anyRunning || len(statuses) > 0 && rt.prepared:
		st.Phase = v1.PodRunning
		if !anyRunning {
			st.Phase = v1.PodPending
		}
	default:
		st.Phase = v1.PodPending
	}
	cond := func(t v1.PodConditionType, ok bool, reason string) {
		status := v1.ConditionFalse
		if ok {
			status, reason = v1.ConditionTrue, ""
		}
		for i := range st.Conditions {
			if st.Conditions[i].Type == t {
				if st.Conditions[i].Status != status {
					st.Conditions[i].LastTransitionTime = now
				}
				st.Conditions[i].Status, st.Conditions[i].Reason = status, reason
				return
			}
		}
		st.Conditions = append(st.Conditions, v1.PodCondition{Type: t, Status: status, Reason: reason, LastTransitionTime: now})
	}
	ended := st.Phase == v1.PodSucceeded || st.Phase == v1.PodFailed
	cond(v1.PodReadyToStartContainers, rt.prepared && !ended, "")
	cond(v1.PodInitialized, initDone, "ContainersNotInitialized")
	cond(v1.ContainersReady, allReady && !ended, "ContainersNotReady")
	cond(v1.PodReady, allReady && !ended, "ContainersNotReady")
	if ended {
		cond(v1.ContainersReady, false, "PodCompleted")
		cond(v1.PodReady, false, "PodCompleted")
	}
	sort.SliceStable(st.Conditions, func(i, j int) bool { return st.Conditions[i].Type < st.Conditions[j].Type })
}

func syscallKillGroup(p *exec.Cmd) error { return syscall.Kill(-p.Process.Pid, syscall.SIGKILL) }
