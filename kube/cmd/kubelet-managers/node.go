// A node that joins a cluster: what `start` with "join" adds to the resource managers.
//
// With "join", the kubelet process this program stands for also talks to the API server, the way
// the kubelet's own loops do, with the kubelet's own code wherever the code is a library:
//   - it registers its Node object (labels, addresses, capacity) and keeps its Lease renewed with
//     the kubelet's lease controller (k8s.io/component-helpers/apimachinery/lease);
//   - every status_interval_ms (the kubelet's nodeStatusUpdateFrequency, 10 s) it copies the device
//     manager's GetCapacity into the Node's capacity and allocatable, as the kubelet's node status
//     setters do;
//   - it watches the pods bound to it and admits each new one through the kubelet's admit handlers
//     in the kubelet's order: the Topology Manager (device manager Allocate for every container)
//     and the predicate handler (resources fit the Node's allocatable, with UpdatePluginResources);
//     a refused pod gets phase Failed and the kubelet's reason and message;
//   - it prepares the pod's ResourceClaims with the DRA manager (NodePrepareResources of the
//     driver that registered through the plugin watcher on plugins_registry), then records, per
//     container, GetDeviceRunContainerOptions and the DRA manager's CDI devices (record_dir);
//   - it "runs" the containers (runtime.go) and reports the pod Running and Ready, or Succeeded /
//     Failed when containers that run exit;
//   - a pod being deleted is stopped, its claims unprepared, and the pod deleted with grace 0
//     (the kubelet's status manager does that once the containers stopped).
//
// What a kubelet does that this does not: no container runtime (no images, no cgroups, no network
// namespaces; containers of images named in "images" run as host processes with their volume
// mounts mapped to host paths, others count as running and never exit: runtime.go); no CPU,
// memory or eviction managers (only the device manager is a hint provider); no volume manager
// (configMap, secret, emptyDir and hostPath volumes only, materialized once at container start); no
// static pods, no image GC, no node shutdown manager; probes are exec probes only (others count as
// passing); container restarts back off from 1 s doubling to 30 s (the kubelet: 10 s to 5 min);
// pod IPs are 127.x.y.z addresses on the loopback interface (node_ip for hostNetwork pods).
//
// The real node (scripts/real_node.py: the kubelet, containerd and runc; tests/node) runs what this
// leaves out, and showed where the two part; this one now keeps a removed device-plugin resource at
// 0 in the Node status, as the kubelet does. What stays different, by design: the Node is always
// Ready (no runtime, no CNI to wait for); images are matched by their last path element, not pulled;
// securityContext, device cgroups and CDI are recorded, not applied (the real node applies them);
// the device manager starts with sources ready and no running containers, so the kubelet's "restart
// with containers still running" branch and a reboot's re-admission (an RDMA pod admitted before its
// plugin registers fails with UnexpectedAdmissionError: docs/operations.md) happen on the real node only.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	clientset "k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/retry"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/component-helpers/apimachinery/lease"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/lifecycle"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
	kubeletutil "k8s.io/kubernetes/pkg/kubelet/util"
	"k8s.io/utils/clock"

	pluginwatcherapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	schedulerframework "k8s.io/kubernetes/pkg/scheduler/framework"
)

const kubeletVersion = "v1.37.2" // reported in the Node's nodeInfo; kube/go.mod pins the code

// joinConfig is the "join" object of a start request.
type joinConfig struct {
	Kubeconfig       string                     `json:"kubeconfig"`
	Node             string                     `json:"node"`
	Labels           map[string]string          `json:"labels"`
	NodeIP           string                     `json:"node_ip"`
	Capacity         map[string]json.RawMessage `json:"capacity"`
	StatusIntervalMs int                        `json:"status_interval_ms"`
	PluginsRegistry  string                     `json:"plugins_registry"`
	StateDir         string                     `json:"state_dir"`
	HostRoot         string                     `json:"host_root"`
	Images           map[string]imageRuntime    `json:"images"`
	RecordDir        string                     `json:"record_dir"`
}

// defaultCapacity is what a node reports besides its devices when "capacity" leaves it out.
var defaultCapacity = map[string]string{"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti"}

func (j *joinConfig) validate() error {
	var missing []string
	if j.Kubeconfig == "" {
		missing = append(missing, "kubeconfig")
	}
	if j.Node == "" {
		missing = append(missing, "node")
	}
	if j.StateDir == "" {
		missing = append(missing, "state_dir")
	}
	if len(missing) > 0 {
		return fmt.Errorf("join needs %s", strings.Join(missing, ", "))
	}
	if j.NodeIP == "" {
		j.NodeIP = "127.0.0.1"
	}
	if ip := net.ParseIP(j.NodeIP); ip == nil || ip.To4() == nil || !ip.IsLoopback() {
		return fmt.Errorf("join.node_ip %q: give an IPv4 loopback address (127.x.y.z): pods of this node get addresses beside it", j.NodeIP)
	}
	if j.StatusIntervalMs <= 0 {
		j.StatusIntervalMs = 10000
	}
	if j.PluginsRegistry == "" {
		j.PluginsRegistry = filepath.Join(j.StateDir, "plugins_registry")
	}
	if j.RecordDir == "" {
		j.RecordDir = filepath.Join(j.StateDir, "pods")
	}
	return nil
}

// baseCapacity: the node's resources other than the device manager's.
func (j *joinConfig) baseCapacity() (v1.ResourceList, error) {
	rl := v1.ResourceList{}
	for k, v := range defaultCapacity {
		rl[v1.ResourceName(k)] = resource.MustParse(v)
	}
	for k, raw := range j.Capacity {
		q, err := quantity(raw)
		if err != nil {
			return nil, fmt.Errorf("join.capacity %q: %v", k, err)
		}
		rl[v1.ResourceName(k)] = q
	}
	return rl, nil
}

// nodeAgent is one kubelet's API-facing loops; it lives from start to stop/crash. The pods' runtime
// state (processes) lives in the server, so it survives a kubelet restart as containers do.
type nodeAgent struct {
	s         *server
	cfg       joinConfig
	client    clientset.Interface
	dm        *devicemanager.ManagerImpl
	tm        topologymanager.Manager
	dra       *dra.Manager
	pred      lifecycle.PodAdmitHandler
	base      v1.ResourceList
	cancel    context.CancelFunc
	done      sync.WaitGroup
	queue     workqueue.TypedRateLimitingInterface[string]
	podLister cache.Indexer
	recorder  record.EventRecorder

	mu        sync.Mutex
	node      *v1.Node // the last Node object written or read
	lastSync  time.Time
	statusErr string
	admitted  map[types.UID]bool   // admitted by this kubelet (the pods stay in s.pods, the pod manager)
	sent      map[types.UID]string // the last status written per pod (JSON), to write only changes
}

func loadClient(kubeconfig string) (clientset.Interface, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("join.kubeconfig %s: %v", kubeconfig, err)
	}
	cfg.QPS, cfg.Burst = 50, 100
	cfg.UserAgent = "kubelet-managers/" + kubeletVersion
	return clientset.NewForConfig(cfg)
}

// startAgent joins the cluster; called by opStart with s.mu NOT held, after the device manager started.
func (s *server) startAgent(cfg joinConfig, dm *devicemanager.ManagerImpl, tm topologymanager.Manager) (*nodeAgent, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	base, err := cfg.baseCapacity()
	if err != nil {
		return nil, err
	}
	client, err := loadClient(cfg.Kubeconfig)
	if err != nil {
		return nil, err
	}
	for _, d := range []string{cfg.StateDir, cfg.PluginsRegistry, cfg.RecordDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithCancel(klog.NewContext(context.Background(), logger))
	a := &nodeAgent{s: s, cfg: cfg, client: client, dm: dm, tm: tm, base: base, cancel: cancel,
		admitted: map[types.UID]bool{}, sent: map[types.UID]string{}}
	a.queue = workqueue.NewTypedRateLimitingQueue(workqueue.NewTypedItemExponentialFailureRateLimiter[string](200*time.Millisecond, 10*time.Second))
	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	a.recorder = broadcaster.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kubelet", Host: cfg.Node})

	if err := a.registerNode(ctx); err != nil {
		cancel()
		return nil, err
	}
	a.pred = lifecycle.NewPredicateAdmitHandler(a.getNodeAnyWay, lifecycle.NewAdmissionFailureHandlerStub(), a.updatePluginResources)

	// The DRA manager and the kubelet's plugin watcher (registration sockets in plugins_registry).
	a.dra, err = dra.NewManager(logger, client, cfg.StateDir)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("DRA manager: %v", err)
	}
	if err := a.dra.Start(ctx, s.activePods, a.getNodeCtx, readyAlways{}); err != nil {
		cancel()
		return nil, fmt.Errorf("DRA manager start: %v", err)
	}
	pm := pluginmanager.NewPluginManager(cfg.PluginsRegistry, a.recorder)
	pm.AddHandler(pluginwatcherapi.DRAPlugin, a.dra.GetWatcherHandler())
	a.done.Add(1)
	go func() { defer a.done.Done(); pm.Run(ctx, readyAlways{}, ctx.Done()) }()

	// Lease: the kubelet's own controller, 40 s duration renewed every 10 s.
	lc := lease.NewController(clock.RealClock{}, client, cfg.Node, 40, func() {}, 10*time.Second, cfg.Node,
		v1.NamespaceNodeLease, kubeletutil.SetNodeOwnerFunc(ctx, client, cfg.Node))
	a.done.Add(1)
	go func() { defer a.done.Done(); lc.Run(ctx) }()

	// Node status sync.
	a.done.Add(1)
	go func() {
		defer a.done.Done()
		wait.UntilWithContext(ctx, a.syncNodeStatus, time.Duration(cfg.StatusIntervalMs)*time.Millisecond)
	}()

	// Pods bound to this node.
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", cfg.Node).String()
	}))
	inf := factory.Core().V1().Pods().Informer()
	enqueue := func(obj any) {
		if k, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			a.queue.Add(k)
		}
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: enqueue, UpdateFunc: func(_, n any) { enqueue(n) }, DeleteFunc: enqueue,
	}); err != nil {
		cancel()
		return nil, err
	}
	a.podLister = inf.GetIndexer()
	factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		cancel()
		return nil, errors.New("the pod informer did not sync")
	}
	// Pods this process ran before a kubelet restart: enqueue them so their state is looked at again.
	for _, k := range s.runtimeKeys() {
		a.queue.Add(k)
	}
	a.done.Add(1)
	go func() { defer a.done.Done(); a.worker(ctx) }()
	// Health updates of the device and DRA managers (ResourceHealthStatus): resync those pods.
	a.done.Add(1)
	go func() {
		defer a.done.Done()
		for {
			select {
			case <-ctx.Done():
				return
			case u := <-dm.Updates():
				a.enqueueUIDs(u.PodUIDs)
			case u := <-a.dra.Updates():
				a.enqueueUIDs(u.PodUIDs)
			}
		}
	}()
	return a, nil
}

func (a *nodeAgent) enqueueUIDs(uids []string) {
	want := map[string]bool{}
	for _, u := range uids {
		want[u] = true
	}
	for _, o := range a.podLister.List() {
		if p, ok := o.(*v1.Pod); ok && want[string(p.UID)] {
			if k, err := cache.MetaNamespaceKeyFunc(p); err == nil {
				a.queue.Add(k)
			}
		}
	}
}

// stop ends the agent's loops (a kubelet stop or crash); processes keep running.
func (a *nodeAgent) stop() {
	a.cancel()
	a.queue.ShutDown()
	a.dra.Stop()
	a.done.Wait()
}

// ---------------------------------------------------------------- the Node

func (a *nodeAgent) getNodeCtx(ctx context.Context) (*v1.Node, error) {
	return a.getNodeAnyWay(ctx, true)
}

// getNodeAnyWay is the kubelet's GetCachedNode: the last Node it wrote or read.
func (a *nodeAgent) getNodeAnyWay(_ context.Context, _ bool) (*v1.Node, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.node == nil {
		return nil, errors.New("the Node is not registered yet")
	}
	return a.node.DeepCopy(), nil
}

func (a *nodeAgent) updatePluginResources(n *schedulerframework.NodeInfo, attrs *lifecycle.PodAdmitAttributes) error {
	return a.dm.UpdatePluginResources(n, attrs)
}

func (a *nodeAgent) capacity() (v1.ResourceList, v1.ResourceList) {
	c, al := a.s.capacity(a.dm)
	capacity, allocatable := a.base.DeepCopy(), a.base.DeepCopy()
	for k, q := range c {
		capacity[k] = q
	}
	for k, q := range al {
		allocatable[k] = q
	}
	return capacity, allocatable
}

func (a *nodeAgent) nodeStatus(old v1.NodeStatus) v1.NodeStatus {
	capacity, allocatable := a.capacity()
	now := metav1.Now()
	st := old.DeepCopy()
	// A resource the device manager no longer reports (its plugin gone past the 5-minute grace) stays
	// in the status at 0, as the kubelet's MachineInfo setter leaves it: it sets the removed resources'
	// capacity to 0 on the Node it read and never deletes a key (the real node shows it, tests/node).
	for k := range old.Capacity {
		if _, ok := capacity[k]; !ok {
			capacity[k] = *resource.NewQuantity(0, resource.DecimalSI)
			allocatable[k] = *resource.NewQuantity(0, resource.DecimalSI)
		}
	}
	st.Capacity, st.Allocatable = capacity, allocatable
	st.Addresses = []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: a.cfg.NodeIP}, {Type: v1.NodeHostName, Address: a.cfg.Node}}
	st.DaemonEndpoints = v1.NodeDaemonEndpoints{KubeletEndpoint: v1.DaemonEndpoint{Port: 10250}}
	st.NodeInfo = v1.NodeSystemInfo{KubeletVersion: kubeletVersion, OperatingSystem: "linux", Architecture: "amd64",
		ContainerRuntimeVersion: "process://kubelet-managers", KernelVersion: "", OSImage: "kubelet-managers (no container runtime)",
		MachineID: a.cfg.Node, SystemUUID: a.cfg.Node, BootID: a.cfg.Node}
	ready := v1.NodeCondition{Type: v1.NodeReady, Status: v1.ConditionTrue, Reason: "KubeletReady",
		Message: "kubelet-managers is posting ready status", LastHeartbeatTime: now, LastTransitionTime: now}
	for _, c := range old.Conditions {
		if c.Type == v1.NodeReady && c.Status == v1.ConditionTrue {
			ready.LastTransitionTime = c.LastTransitionTime
		}
	}
	conds := []v1.NodeCondition{ready}
	for _, t := range []v1.NodeConditionType{v1.NodeMemoryPressure, v1.NodeDiskPressure, v1.NodePIDPressure} {
		c := v1.NodeCondition{Type: t, Status: v1.ConditionFalse, Reason: "KubeletHas" + strings.TrimPrefix(string(t), "Node"),
			LastHeartbeatTime: now, LastTransitionTime: now}
		for _, o := range old.Conditions {
			if o.Type == t && o.Status == v1.ConditionFalse {
				c.LastTransitionTime = o.LastTransitionTime
			}
		}
		conds = append(conds, c)
	}
	st.Conditions = conds
	return *st
}

// registerNode creates the Node (or takes the existing one, as a restarted kubelet does) and writes
// its status once, so the scheduler sees it Ready with its capacity.
func (a *nodeAgent) registerNode(ctx context.Context) error {
	labels := map[string]string{"kubernetes.io/hostname": a.cfg.Node, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
	for k, v := range a.cfg.Labels {
		labels[k] = v
	}
	n := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: a.cfg.Node, Labels: labels}}
	created, err := a.client.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
	switch {
	case err == nil:
		n = created
	case apierrors.IsAlreadyExists(err):
		// The kubelet reconciles only its own labels on an existing Node: others (set by an
		// operator, e.g. the mode label) stay.
		err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
			cur, err := a.client.CoreV1().Nodes().Get(ctx, a.cfg.Node, metav1.GetOptions{})
			if err != nil {
				return err
			}
			if cur.Labels == nil {
				cur.Labels = map[string]string{}
			}
			for _, k := range []string{"kubernetes.io/hostname", "kubernetes.io/os", "kubernetes.io/arch"} {
				cur.Labels[k] = labels[k]
			}
			n, err = a.client.CoreV1().Nodes().Update(ctx, cur, metav1.UpdateOptions{})
			return err
		})
		if err != nil {
			return fmt.Errorf("updating Node %s: %v", a.cfg.Node, err)
		}
	default:
		return fmt.Errorf("registering Node %s with the API server (join.kubeconfig %s): %v", a.cfg.Node, a.cfg.Kubeconfig, err)
	}
	a.mu.Lock()
	a.node = n
	a.mu.Unlock()
	a.syncNodeStatus(ctx)
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.statusErr != "" {
		return fmt.Errorf("writing Node %s status: %s", a.cfg.Node, a.statusErr)
	}
	return nil
}

func (a *nodeAgent) syncNodeStatus(ctx context.Context) {
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := a.client.CoreV1().Nodes().Get(ctx, a.cfg.Node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		cur.Status = a.nodeStatus(cur.Status)
		n, err := a.client.CoreV1().Nodes().UpdateStatus(ctx, cur, metav1.UpdateOptions{})
		if err == nil {
			a.mu.Lock()
			a.node, a.lastSync = n, time.Now()
			a.mu.Unlock()
		}
		return err
	})
	a.mu.Lock()
	defer a.mu.Unlock()
	if err != nil {
		a.statusErr = err.Error()
		logger.Error(err, "node status sync")
	} else {
		a.statusErr = ""
	}
}

// ---------------------------------------------------------------- pods

func (a *nodeAgent) worker(ctx context.Context) {
	for {
		k, quit := a.queue.Get()
		if quit {
			return
		}
		func() {
			defer a.queue.Done(k)
			retryAfter, err := a.syncPod(ctx, k)
			switch {
			case err != nil && ctx.Err() == nil:
				logger.Error(err, "pod sync", "pod", k)
				a.queue.AddRateLimited(k)
			case retryAfter > 0:
				a.queue.Forget(k)
				a.queue.AddAfter(k, retryAfter)
			default:
				a.queue.Forget(k)
			}
		}()
	}
}

// syncPod is the pod worker's SyncPod for one pod key; it returns when to look again (0: at the
// next event).
func (a *nodeAgent) syncPod(ctx context.Context, key string) (time.Duration, error) {
	obj, exists, err := a.podLister.GetByKey(key)
	if err != nil {
		return 0, err
	}
	if !exists {
		// Gone from the API server (deleted with grace 0 by us or by force): stop what is left and
		// unprepare its claims with the last pod object seen (the kubelet's pod workers keep it
		// until the pod is terminated); a failed unprepare is retried.
		for _, uid := range a.s.runtimeUIDs(key) {
			if err := a.teardown(ctx, key, uid, nil, 0); err != nil {
				return 0, err
			}
		}
		return 0, nil
	}
	pod := obj.(*v1.Pod).DeepCopy()
	for _, uid := range a.s.runtimeUIDs(key) {
		if uid != pod.UID { // same name, new pod: the old one is gone
			if err := a.teardown(ctx, key, uid, nil, 0); err != nil {
				return 0, err
			}
		}
	}
	if pod.DeletionTimestamp != nil {
		grace := int64(30)
		if pod.DeletionGracePeriodSeconds != nil {
			grace = *pod.DeletionGracePeriodSeconds
		}
		if err := a.teardown(ctx, key, pod.UID, pod, time.Duration(grace)*time.Second); err != nil {
			return 0, err
		}
		// The status manager deletes the pod once its containers stopped and its claims were
		// unprepared: grace 0, with the UID as precondition.
		err := a.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
			GracePeriodSeconds: new(int64), Preconditions: metav1.NewUIDPreconditions(string(pod.UID))})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			return 0, err
		}
		return 0, nil
	}
	if pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed {
		a.s.forgetPod(pod.UID)
		return 0, a.teardownRuntime(ctx, key, pod.UID, pod, 0)
	}
	a.mu.Lock()
	admitted := a.admitted[pod.UID]
	a.mu.Unlock()
	if !admitted {
		if ok, reason, msg := a.admit(ctx, pod); !ok {
			a.recorder.Eventf(pod, v1.EventTypeWarning, reason, msg)
			return 0, a.writeStatus(ctx, pod, func(st *v1.PodStatus) {
				st.Phase, st.Reason, st.Message = v1.PodFailed, reason, "Pod was rejected: "+msg
			})
		}
	}
	rt := a.s.runtimeFor(a, key, pod)
	if !rt.isPrepared() {
		if err := a.dra.PrepareResources(ctx, pod); err != nil {
			rt.setPrepareError(err)
			a.recorder.Eventf(pod, v1.EventTypeWarning, "FailedPrepareDynamicResources", "Failed to prepare dynamic resources: %v", err)
			a.writeRecord(pod, rt)
			return 0, fmt.Errorf("prepare dynamic resources: %w", err)
		}
		rt.setPrepared()
		if err := a.collectRunOptions(ctx, pod, rt); err != nil {
			a.recorder.Eventf(pod, v1.EventTypeWarning, "Failed", "%v", err)
			a.writeRecord(pod, rt)
			return 0, err
		}
		a.writeRecord(pod, rt)
	}
	next := rt.advance(ctx, a, pod)
	if err := a.writeStatus(ctx, pod, func(st *v1.PodStatus) { rt.status(a, pod, st) }); err != nil {
		return 0, err
	}
	return next, nil
}

// admit runs the kubelet's admit handlers for a new pod, in the kubelet's order.
func (a *nodeAgent) admit(ctx context.Context, pod *v1.Pod) (bool, string, string) {
	a.s.mu.Lock()
	others := make([]*v1.Pod, 0, len(a.s.pods))
	for uid, p := range a.s.pods {
		if uid != pod.UID {
			others = append(others, p)
		}
	}
	a.s.pods[pod.UID] = pod // the pod manager holds it while it is admitted: it is active
	a.s.mu.Unlock()
	attrs := &lifecycle.PodAdmitAttributes{Pod: pod, OtherPods: others, Operation: lifecycle.AddOperation}
	for _, h := range []lifecycle.PodAdmitHandler{a.tm, a.pred} {
		if r := h.Admit(ctx, attrs); !r.Admit {
			a.s.forgetPod(pod.UID)
			return false, r.Reason, r.Message
		}
	}
	a.mu.Lock()
	a.admitted[pod.UID] = true
	a.mu.Unlock()
	return true, "", ""
}

// collectRunOptions: what every container gets (device manager run options, DRA CDI devices).
func (a *nodeAgent) collectRunOptions(ctx context.Context, pod *v1.Pod, rt *podRuntime) error {
	for _, c := range allContainers(pod) {
		o, err := runOptions(a.dm, pod, c)
		if err != nil {
			return fmt.Errorf("container %s: device run options: %v", c.Name, err)
		}
		info, err := a.dra.GetResources(pod, c)
		if err != nil {
			return fmt.Errorf("container %s: dynamic resources: %v", c.Name, err)
		}
		cdi := o["cdi_devices"].([]string)
		for _, d := range info.CDIDevices {
			cdi = append(cdi, d.Name)
		}
		sort.Strings(cdi)
		o["cdi_devices"] = cdi
		rt.setRunOptions(c.Name, o)
	}
	return nil
}

func (a *nodeAgent) writeRecord(pod *v1.Pod, rt *podRuntime) {
	rec := rt.record(pod)
	b, _ := json.MarshalIndent(rec, "", "  ")
	path := filepath.Join(a.cfg.RecordDir, pod.Namespace+"_"+pod.Name+".json")
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o640); err == nil {
		_ = os.Rename(tmp, path)
	}
}

// writeStatus sets the status fields the kubelet owns and writes them when they changed.
func (a *nodeAgent) writeStatus(ctx context.Context, pod *v1.Pod, set func(*v1.PodStatus)) error {
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := a.client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		if cur.UID != pod.UID {
			return nil
		}
		st := cur.Status.DeepCopy()
		set(st)
		if a.dra != nil {
			a.dm.UpdateAllocatedResourcesStatus(logger, cur, st)
			a.dra.UpdateAllocatedResourcesStatus(logger, cur, st)
		}
		b, _ := json.Marshal(stripTimes(st))
		a.mu.Lock()
		same := a.sent[pod.UID] == string(b)
		a.mu.Unlock()
		if same {
			return nil
		}
		cur.Status = *st
		if _, err := a.client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, cur, metav1.UpdateOptions{}); err != nil {
			return err
		}
		a.mu.Lock()
		a.sent[pod.UID] = string(b)
		a.mu.Unlock()
		return nil
	})
}

// stripTimes: a status without its timestamps, to tell a change from a re-write.
func stripTimes(st *v1.PodStatus) *v1.PodStatus {
	c := st.DeepCopy()
	for i := range c.Conditions {
		c.Conditions[i].LastProbeTime, c.Conditions[i].LastTransitionTime = metav1.Time{}, metav1.Time{}
	}
	return c
}

// teardown stops a pod's containers (grace first), unprepares its claims and forgets it.
func (a *nodeAgent) teardown(ctx context.Context, key string, uid types.UID, pod *v1.Pod, grace time.Duration) error {
	if err := a.teardownRuntime(ctx, key, uid, pod, grace); err != nil {
		return err
	}
	a.s.forgetPod(uid)
	a.mu.Lock()
	delete(a.admitted, uid)
	delete(a.sent, uid)
	a.mu.Unlock()
	return nil
}

func (a *nodeAgent) teardownRuntime(ctx context.Context, key string, uid types.UID, pod *v1.Pod, grace time.Duration) error {
	// The runtime stays until the claims are unprepared, so a failed unprepare (the driver not
	// registered yet) is retried, also once the pod is gone from the API server.
	rt := a.s.peekRuntime(key, uid)
	if rt != nil {
		rt.kill(grace)
		if pod == nil {
			rt.mu.Lock()
			pod = rt.pod
			rt.mu.Unlock()
		}
	}
	if pod != nil && (rt == nil || rt.isPrepared()) {
		if err := a.dra.UnprepareResources(ctx, pod); err != nil {
			return fmt.Errorf("unprepare dynamic resources: %w", err)
		}
	}
	a.s.takeRuntime(key, uid)
	if rt != nil && pod != nil {
		path := filepath.Join(a.cfg.RecordDir, pod.Namespace+"_"+pod.Name+".json")
		_ = os.Remove(path)
	}
	return nil
}

// agentStatus is the "node" part of the status op.
func (a *nodeAgent) agentStatus() obj {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := obj{"node": a.cfg.Node, "node_ip": a.cfg.NodeIP, "admitted": len(a.admitted), "record_dir": a.cfg.RecordDir,
		"plugins_registry": a.cfg.PluginsRegistry}
	if !a.lastSync.IsZero() {
		out["status_synced_ms_ago"] = ms(time.Since(a.lastSync))
	}
	if a.statusErr != "" {
		out["status_error"] = a.statusErr
	}
	return out
}

// opSyncNode writes the Node status now (tests need not wait for the next interval).
func (s *server) opSyncNode() (obj, error) {
	s.mu.Lock()
	a := s.agent
	s.mu.Unlock()
	if a == nil {
		return nil, errors.New("this kubelet has not joined a cluster (start with join)")
	}
	a.syncNodeStatus(context.Background())
	st := a.agentStatus()
	if e, ok := st["status_error"]; ok {
		return nil, fmt.Errorf("node status sync: %v", e)
	}
	c, al := a.capacity()
	return obj{"capacity": quantities(c), "allocatable": quantities(al)}, nil
}
