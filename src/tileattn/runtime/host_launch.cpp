// The eager forward's host work in one compiled call (issue #9, docs/runtime.md "The compiled
// forward path").
//
// tileattn.attention(q, k, v) without autograd spends its host time in Python: the plan key
// (shapes, strides, dtypes, devices, flags), two torch allocations, the current stream, the
// tensor-map and tile-counter lookups, and cuda.bindings' cuLaunchKernel wrapper. This module does
// the same steps for a combination the Python path has already validated and planned:
//
//   forward(q, k, v, causal, scale, want, deterministic=False)
//       -> out (want 0) | (out, lse) (1) | (out, lse, entry) (2) | (out, lse) with autograd (3) | None
//
// It builds the key from the tensors, finds the record that tileattn.api registered for it (the
// LaunchPlan's packed parameter buffer, which parameters change per call, and the output specs),
// allocates out (and lse) with ATen, fills in the data pointers and tensor maps, and calls
// cuLaunchKernel on torch's current stream; with want 3 that launch is the forward of a C++ autograd
// Function whose backward calls tileattn.api._backward. None means "not mine": no record, another current
// device, a misaligned pointer, a stream under capture with a persistent grid, an argument of an
// unexpected type. The caller then takes the Python path, which checks everything and raises the
// errors. Nothing here validates more than that: a record exists only for a key the Python path
// accepted, and the key holds everything that path checks except the data pointers' alignment.
//
// It launches the plan's own kernel with the plan's own packed bytes, so it is the Python
// LaunchPlan's launch done in C++, not a second way of setting up a kernel. The driver entry points
// come from cuGetProcAddress (through cuda.bindings, in Python), so no CUDA header or library is
// needed to build it: a C++17 compiler, Python's headers and torch's.
//
// Thread safety: everything runs under the GIL. The only calls back into Python (a tensor map's
// encoder on a new address, the stream's tile-counter pair on a new stream) happen before any byte
// of the shared parameter buffer is written, so another thread that runs while they hold the GIL
// cannot interleave with a launch.

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <unordered_map>
#include <vector>

namespace {

// ---- the driver entry points (cuda.h's signatures; addresses from cuGetProcAddress) -------------
using CUresult = int;
using LaunchKernelFn = CUresult (*)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                                    unsigned block_x, unsigned block_y, unsigned block_z, unsigned smem_bytes,
                                    void* stream, void** kernel_params, void** extra);
using StreamIsCapturingFn = CUresult (*)(void* stream, int* capture_status);  // 0: CU_STREAM_CAPTURE_STATUS_NONE

LaunchKernelFn launch_kernel = nullptr;
StreamIsCapturingFn stream_is_capturing = nullptr;
PyObject* stream_counters = nullptr;  // runtime.stream_counters(device_index) -> int address
PyObject* launch_error = nullptr;     // runtime.LaunchError
PyObject* plans_namespace = nullptr;  // tileattn.api's globals: a record serves while "_plans" is its dict
PyObject* plans_name = nullptr;       // the interned string "_plans"
// The device type whose tensors it serves: CUDA, except in the CPU tests of the packing and
// caching logic (configure(..., "cpu") with a stand-in for cuLaunchKernel), where the device index
// is -1 and the stream null.
c10::DeviceType served_type = c10::DeviceType::CUDA;
bool poison_outputs = false;          // tests: fill out and lse with NaN before the launch (set_poison)
bool interpreter_exiting = false;     // set by the atexit hook that the module's init registers

constexpr size_t kMaxRecords = 8192;  // start over beyond this (tileattn.api clears at 4096 plans first)
constexpr size_t kMaxMapsPerSlot = 64;  // encoded tensor maps kept per slot (per address)

// ---- the key: everything the Python path's plan key holds ----------------------------------------
struct Key {
  int64_t shape_strides[3][8];  // q, k, v: sizes then strides (rank 4)
  int8_t dtype[3];
  int8_t device[3];
  int8_t causal;
  int8_t has_scale;
  double scale;

  bool operator==(const Key& other) const { return std::memcmp(this, &other, sizeof(Key)) == 0; }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    // FNV-1a over the bytes (the struct is memset to 0 first, so padding is deterministic)
    const auto* bytes = reinterpret_cast<const unsigned char*>(&key);
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof(Key); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

// ---- a record: one planned (key -> kernel launch) -------------------------------------------------
enum SlotKind : int { kPointer = 0, kTensorMap = 1, kTileCounter = 2 };
constexpr int kSources = 5;  // q, k, v, out, lse
constexpr int kMaxTensorMaps = 8;

struct alignas(64) MapBytes {
  unsigned char bytes[128];  // one CUtensorMap
};

struct Slot {
  int kind;
  int param;   // kernel parameter index
  int source;  // kPointer / kTensorMap: 0 q, 1 k, 2 v, 3 out, 4 lse
  PyObject* encode = nullptr;  // kTensorMap: TensorMapTemplate.encode (owned reference)
  std::unordered_map<uint64_t, MapBytes> maps;  // kTensorMap: encoded maps by address
};

struct Record {
  PyObject* entry = nullptr;  // tileattn.api._PlanEntry (owned reference), returned with want == 2
  PyObject* plans = nullptr;  // the tileattn.api._plans dict the entry was made for (owned reference)
  void* function = nullptr;
  unsigned grid[3], block[3], smem;
  int device;
  std::vector<uint64_t> buffer;        // the packed parameters, 8-byte aligned
  std::vector<size_t> param_offsets;   // byte offset of each kernel parameter in buffer
  std::vector<void*> params;           // cuLaunchKernel's kernelParams: into buffer, or a map's bytes
  std::vector<Slot> slots;
  std::vector<int64_t> out_sizes, out_strides, lse_sizes, lse_strides;
  at::Tensor unread_lse;                         // lse's target when the caller does not want it
  std::unordered_map<void*, uint64_t> counters;  // stream -> its tile-counter pair's address

  ~Record() {
    Py_XDECREF(entry);
    Py_XDECREF(plans);
    for (Slot& slot : slots) Py_XDECREF(slot.encode);
  }
};

// Never destroyed: at process exit the interpreter (whose references the records hold) is gone.
std::unordered_map<Key, std::shared_ptr<Record>, KeyHash>& records =
    *new std::unordered_map<Key, std::shared_ptr<Record>, KeyHash>();

// Fills `key` from the call's arguments; false when they are not a combination a record could
// hold (not plain CUDA tensors of rank 4, causal not a bool, scale neither None nor a float).
bool make_key(PyObject* const* tensors, PyObject* causal, PyObject* scale, Key& key) {
  std::memset(&key, 0, sizeof(Key));
  for (int i = 0; i < 3; ++i) {
    if (!THPVariable_CheckExact(tensors[i])) return false;
    const at::Tensor& t = THPVariable_Unpack(tensors[i]);
    if (t.dim() != 4 || t.layout() != c10::kStrided || t.device().type() != served_type) return false;
    for (int d = 0; d < 4; ++d) {
      key.shape_strides[i][d] = t.size(d);
      key.shape_strides[i][4 + d] = t.stride(d);
    }
    key.dtype[i] = static_cast<int8_t>(t.scalar_type());
    key.device[i] = static_cast<int8_t>(t.get_device());
  }
  if (causal != Py_True && causal != Py_False) return false;
  key.causal = causal == Py_True;
  if (scale == Py_None) return true;
  if (!PyFloat_CheckExact(scale)) return false;
  key.has_scale = 1;
  key.scale = PyFloat_AS_DOUBLE(scale);
  return true;
}

bool read_int64s(PyObject* sequence, std::vector<int64_t>& out, const char* what) {
  PyObject* fast = PySequence_Fast(sequence, what);
  if (fast == nullptr) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (out[i] == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
  }
  Py_DECREF(fast);
  return true;
}

uint64_t call_for_uint64(PyObject* callable, PyObject* argument) {
  // callable(argument) as an unsigned 64-bit int (0 with a Python exception set on failure).
  PyObject* result = PyObject_CallOneArg(callable, argument);
  if (result == nullptr) return 0;
  const uint64_t value = PyLong_AsUnsignedLongLong(result);
  Py_DECREF(result);
  return (value == static_cast<uint64_t>(-1) && PyErr_Occurred()) ? 0 : value;
}

// ---- one launch ---------------------------------------------------------------------------------------
// A call the module serves: its record, the current stream and the operands' data pointers.
struct Call {
  std::shared_ptr<Record> record;  // alive even if a callback clears `records`
  void* stream = nullptr;
  uint64_t qkv[3] = {0, 0, 0};
};

// Whether the module serves this call (fills `call`); false with a Python error set on failure,
// false without one for a call it leaves to the Python path. Nothing here calls back into Python.
bool find_call(PyObject* const* args, Call& call) {
  Key key;
  if (!make_key(args, args[3], args[4], key)) return false;
  auto found = records.find(key);
  if (found == records.end()) return false;
  const std::shared_ptr<Record>& record = found->second;
  // tileattn.api's plan cache replaced (a test's monkeypatch): its entries are not the records' entries.
  if (PyDict_GetItemWithError(plans_namespace, plans_name) != record->plans) return false;
  for (int i = 0; i < 3; ++i) call.qkv[i] = reinterpret_cast<uint64_t>(THPVariable_Unpack(args[i]).data_ptr());
  if ((call.qkv[0] | call.qkv[1] | call.qkv[2]) & 15) return false;  // the Python path raises the alignment error
  // cuLaunchKernel uses the thread's current context: only launch on the record's device, on torch's
  // current stream there.
  if (served_type == c10::DeviceType::CUDA) {
    const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    const c10::Device device = cuda->getDevice();
    if (device.index() != record->device) return false;
    call.stream = cuda->getStream(device).native_handle();
  }
  for (const Slot& slot : record->slots) {
    if (slot.kind != kTileCounter) continue;
    int capture_status = 0;
    if (stream_is_capturing(call.stream, &capture_status) != 0 || capture_status != 0) {
      return false;  // under capture the graph needs a counter pair of its own (runtime.stream_counters)
    }
  }
  call.record = record;
  return true;
}

[[noreturn]] void throw_python_error() {
  python_error error;  // torch/csrc/Exceptions.h (global namespace)
  error.persist();  // the current Python exception, re-raised where the C++ exception is caught
  throw error;
}

// Allocates out (and a fresh lse, or the record's unread buffer) and launches. Python errors (from a
// tensor map's encoder, the counter lookup, the driver) are thrown as torch::python_error.
void launch(const Call& call, const at::Tensor& q, bool fresh_lse, at::Tensor& out, at::Tensor& lse) {
  Record& record = *call.record;
  // Everything that may call back into Python comes before the first write to record.buffer.
  uint64_t counter = 0;
  for (const Slot& slot : record.slots) {
    if (slot.kind != kTileCounter) continue;
    auto hit = record.counters.find(call.stream);
    if (hit != record.counters.end()) {
      counter = hit->second;
      continue;
    }
    PyObject* index = PyLong_FromLong(record.device);
    if (index == nullptr) throw_python_error();
    counter = call_for_uint64(stream_counters, index);
    Py_DECREF(index);
    if (PyErr_Occurred()) throw_python_error();
    record.counters.emplace(call.stream, counter);
  }
  out = at::empty_strided(record.out_sizes, record.out_strides, q.options());
  lse = fresh_lse ? at::empty_strided(record.lse_sizes, record.lse_strides, q.options().dtype(at::kFloat))
                  : record.unread_lse;
  if (poison_outputs) {  // as the GPU tests' poisoned_allocations() does on the Python path
    out.fill_(std::numeric_limits<double>::quiet_NaN());
    lse.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  const uint64_t sources[5] = {call.qkv[0], call.qkv[1], call.qkv[2], reinterpret_cast<uint64_t>(out.data_ptr()),
                               reinterpret_cast<uint64_t>(lse.data_ptr())};
  // Tensor maps are copied out of the per-slot caches: a later callback may clear a cache.
  MapBytes maps[kMaxTensorMaps];  // register() allows no more map slots than this
  int map_count = 0;
  for (Slot& slot : record.slots) {
    if (slot.kind != kTensorMap) continue;
    const uint64_t address = sources[slot.source];
    auto hit = slot.maps.find(address);
    if (hit == slot.maps.end()) {
      // TensorMapTemplate.encode(address).address: the host address of the map's 128 bytes, alive
      // while the returned TensorMap is; copied before it is released.
      PyObject* py_address = PyLong_FromUnsignedLongLong(address);
      if (py_address == nullptr) throw_python_error();
      PyObject* tmap = PyObject_CallOneArg(slot.encode, py_address);
      Py_DECREF(py_address);
      if (tmap == nullptr) throw_python_error();
      PyObject* host = PyObject_GetAttrString(tmap, "address");
      const uint64_t host_address = host == nullptr ? 0 : PyLong_AsUnsignedLongLong(host);
      Py_XDECREF(host);
      if (PyErr_Occurred()) {
        Py_DECREF(tmap);
        throw_python_error();
      }
      if (slot.maps.size() >= kMaxMapsPerSlot) slot.maps.clear();
      hit = slot.maps.emplace(address, MapBytes{}).first;
      std::memcpy(hit->second.bytes, reinterpret_cast<const void*>(host_address), sizeof(MapBytes::bytes));
      Py_DECREF(tmap);
    }
    maps[map_count++] = hit->second;
  }

  // From here on no Python code runs until the launch has returned (the GIL is held throughout).
  auto* bytes = reinterpret_cast<unsigned char*>(record.buffer.data());
  map_count = 0;
  for (const Slot& slot : record.slots) {
    if (slot.kind == kTensorMap) {
      record.params[slot.param] = maps[map_count++].bytes;  // the driver copies the 128 bytes
    } else {
      const uint64_t value = slot.kind == kTileCounter ? counter : sources[slot.source];
      std::memcpy(bytes + record.param_offsets[slot.param], &value, sizeof(value));
    }
  }
  const CUresult err = launch_kernel(record.function, record.grid[0], record.grid[1], record.grid[2], record.block[0],
                                     record.block[1], record.block[2], record.smem, call.stream, record.params.data(),
                                     nullptr);
  if (err != 0) {
    PyErr_Format(launch_error, "cuLaunchKernel (compiled forward path) failed: CUresult %d, grid (%u, %u, %u), "
                 "block (%u, %u, %u), smem %u", err, record.grid[0], record.grid[1], record.grid[2],
                 record.block[0], record.block[1], record.block[2], record.smem);
    throw_python_error();
  }
}

// ---- autograd: the forward through the compiled path, the backward through tileattn.api._backward ----
// The plan entry travels with the graph (the backward's plans hang off it); its reference is
// dropped with the GIL held, whichever thread frees the graph (torch may free it without the GIL).
struct EntryHolder : torch::CustomClassHolder {
  PyObject* entry;
  explicit EntryHolder(PyObject* object) : entry(object) { Py_INCREF(entry); }
  ~EntryHolder() override {
    // A graph freed while the interpreter shuts down keeps its reference (PyGILState_Ensure may not
    // run then): interpreter_exiting is set by an atexit hook, which runs before modules are torn down.
    if (!interpreter_exiting) {
      PyGILState_STATE state = PyGILState_Ensure();
      Py_DECREF(entry);
      PyGILState_Release(state);
    }
  }
};

struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
  // call_address: the Call found by find_call (alive for the duration of apply).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v, int64_t call_address,
                                                bool deterministic) {
    const Call& call = *reinterpret_cast<const Call*>(call_address);
    at::Tensor out, lse;
    launch(call, q, /*fresh_lse=*/true, out, lse);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["entry"] = c10::IValue::make_capsule(c10::make_intrusive<EntryHolder>(call.record->entry));
    ctx->saved_data["deterministic"] = deterministic;
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);  // lse never has a gradient: no zeros tensor is made for it
    return {out, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& dout = grads[0];
    if (!dout.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const torch::autograd::variable_list saved = ctx->get_saved_variables();  // q, k, v, out, lse
    auto holder = c10::static_intrusive_pointer_cast<EntryHolder>(ctx->saved_data["entry"].toCapsule());
    const bool deterministic = ctx->saved_data["deterministic"].toBool();
    pybind11::gil_scoped_acquire gil;
    // tileattn.api._backward(entry, dout, q, k, v, out, lse, deterministic) -> (dq, dk, dv)
    PyObject* backward_fn = PyDict_GetItemString(plans_namespace, "_backward");
    if (backward_fn == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "host_launch: tileattn.api has no _backward");
      throw_python_error();
    }
    PyObject* call_args = Py_BuildValue("(ONNNNNNO)", holder->entry, THPVariable_Wrap(dout), THPVariable_Wrap(saved[0]),
                                        THPVariable_Wrap(saved[1]), THPVariable_Wrap(saved[2]),
                                        THPVariable_Wrap(saved[3]), THPVariable_Wrap(saved[4]),
                                        deterministic ? Py_True : Py_False);
    if (call_args == nullptr) throw_python_error();
    PyObject* result = PyObject_Call(backward_fn, call_args, nullptr);
    Py_DECREF(call_args);
    if (result == nullptr) throw_python_error();
    torch::autograd::variable_list grads_in{at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const bool triple = PyTuple_Check(result) && PyTuple_GET_SIZE(result) == 3;
    for (int i = 0; triple && i < 3; ++i) {
      PyObject* item = PyTuple_GET_ITEM(result, i);
      if (!THPVariable_Check(item)) break;
      grads_in[i] = THPVariable_Unpack(item);
    }
    Py_DECREF(result);
    if (!triple || !grads_in[0].defined() || !grads_in[1].defined() || !grads_in[2].defined()) {
      PyErr_SetString(PyExc_RuntimeError, "host_launch: tileattn.api._backward must return (dq, dk, dv) tensors");
      throw_python_error();
    }
    return grads_in;
  }
};

// ---- forward(q, k, v, causal, scale, want, deterministic=False) ---------------------------------------
// want: 0 out, 1 (out, lse), 2 (out, lse, entry), 3 (out, lse) with out attached to autograd
// (AttentionFunction; deterministic picks the backward's mode).
PyObject* forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 6 && nargs != 7) {
    PyErr_SetString(PyExc_TypeError, "forward(q, k, v, causal, scale, want, deterministic=False) takes 6 or 7 "
                    "arguments");
    return nullptr;
  }
  const long want = PyLong_AsLong(args[5]);
  if (want < 0 || want > 3) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "want must be 0, 1, 2 or 3");
    return nullptr;
  }
  const int deterministic = nargs == 7 ? PyObject_IsTrue(args[6]) : 0;
  if (deterministic < 0) return nullptr;
  Call call;
  if (!find_call(args, call)) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  const at::Tensor& q = THPVariable_Unpack(args[0]);
  at::Tensor out, lse;
  if (want == 3) {
    torch::autograd::variable_list outputs = AttentionFunction::apply(
        q, THPVariable_Unpack(args[1]), THPVariable_Unpack(args[2]), reinterpret_cast<int64_t>(&call),
        deterministic != 0);
    out = std::move(outputs[0]);
    lse = std::move(outputs[1]);
  } else {
    launch(call, q, /*fresh_lse=*/want != 0, out, lse);
  }
  if (want == 0) return THPVariable_Wrap(std::move(out));
  PyObject* result = PyTuple_New(want == 2 ? 3 : 2);
  if (result == nullptr) return nullptr;
  PyTuple_SET_ITEM(result, 0, THPVariable_Wrap(std::move(out)));
  PyTuple_SET_ITEM(result, 1, THPVariable_Wrap(std::move(lse)));
  if (want == 2) {
    Py_INCREF(call.record->entry);
    PyTuple_SET_ITEM(result, 2, call.record->entry);
  }
  if (PyTuple_GET_ITEM(result, 0) == nullptr || PyTuple_GET_ITEM(result, 1) == nullptr) {
    Py_DECREF(result);  // a wrap failed (out of memory): its exception is set
    return nullptr;
  }
  return result;
  END_HANDLE_TH_ERRORS
}

// ---- register(...): a record for the key of (q, k, v, causal, scale) ------------------------------
PyObject* register_record(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  if (plans_namespace == nullptr || launch_kernel == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "register: configure the module first (tileattn.runtime.host_launch.load)");
    return nullptr;
  }
  PyObject *q, *k, *v, *causal, *scale, *entry, *grid, *block, *offsets, *slots, *out_sizes, *out_strides,
      *lse_sizes, *lse_strides, *unread_lse;
  unsigned long long function;
  unsigned int smem;
  int device;
  Py_buffer buffer;
  if (!PyArg_ParseTuple(args, "OOOOOOKiOOIy*OOOOOOO:register", &q, &k, &v, &causal, &scale, &entry, &function,
                        &device, &grid, &block, &smem, &buffer, &offsets, &slots, &out_sizes, &out_strides,
                        &lse_sizes, &lse_strides, &unread_lse)) {
    return nullptr;
  }
  auto record = std::make_shared<Record>();
  record->buffer.resize((buffer.len + 7) / 8 + 1, 0);
  std::memcpy(record->buffer.data(), buffer.buf, buffer.len);
  const size_t buffer_bytes = static_cast<size_t>(buffer.len);
  PyBuffer_Release(&buffer);
  PyObject* const qkv[3] = {q, k, v};
  Key key;
  if (!make_key(qkv, causal, scale, key)) {
    PyErr_SetString(PyExc_ValueError, "register: q, k, v must be tensors of rank 4 on the served device type, "
                    "causal a bool and scale None or a float");
    return nullptr;
  }
  if (!THPVariable_Check(unread_lse)) {
    PyErr_SetString(PyExc_TypeError, "register: unread_lse must be a tensor");
    return nullptr;
  }
  std::vector<int64_t> geometry;
  if (!read_int64s(grid, geometry, "grid") || geometry.size() != 3) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "register: grid must have 3 entries");
    return nullptr;
  }
  for (int i = 0; i < 3; ++i) record->grid[i] = static_cast<unsigned>(geometry[i]);
  if (!read_int64s(block, geometry, "block") || geometry.size() != 3) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "register: block must have 3 entries");
    return nullptr;
  }
  for (int i = 0; i < 3; ++i) record->block[i] = static_cast<unsigned>(geometry[i]);
  std::vector<int64_t> param_offsets;
  if (!read_int64s(offsets, param_offsets, "param_offsets")) return nullptr;
  for (int64_t offset : param_offsets) {
    if (offset < 0 || static_cast<size_t>(offset) + 8 > record->buffer.size() * 8) {
      PyErr_Format(PyExc_ValueError, "register: parameter offset %lld outside the %zu-byte buffer",
                   static_cast<long long>(offset), buffer_bytes);
      return nullptr;
    }
    record->param_offsets.push_back(static_cast<size_t>(offset));
  }
  PyObject* fast = PySequence_Fast(slots, "slots");
  if (fast == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    Slot slot;
    PyObject* encode = Py_None;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "iiiO:slot", &slot.kind, &slot.param, &slot.source,
                          &encode)) {
      Py_DECREF(fast);
      return nullptr;
    }
    const bool valid = slot.kind >= kPointer && slot.kind <= kTileCounter && slot.param >= 0 &&
                       static_cast<size_t>(slot.param) < record->param_offsets.size() &&
                       (slot.kind == kTileCounter || (slot.source >= 0 && slot.source < kSources)) &&
                       (slot.kind != kTensorMap || PyCallable_Check(encode)) &&
                       (slot.kind == kTensorMap || record->param_offsets[slot.param] % 8 == 0);
    if (!valid) {
      Py_DECREF(fast);
      PyErr_Format(PyExc_ValueError, "register: slot %zd is malformed", i);
      return nullptr;
    }
    if (slot.kind == kTensorMap) {
      Py_INCREF(encode);
      slot.encode = encode;
    }
    record->slots.push_back(std::move(slot));
  }
  Py_DECREF(fast);
  size_t map_slots = 0;
  for (const Slot& slot : record->slots) map_slots += slot.kind == kTensorMap;
  if (map_slots > kMaxTensorMaps) {
    PyErr_Format(PyExc_ValueError, "register: %zu tensor-map slots, at most %d", map_slots, kMaxTensorMaps);
    return nullptr;
  }
  if (!read_int64s(out_sizes, record->out_sizes, "out_sizes") ||
      !read_int64s(out_strides, record->out_strides, "out_strides") ||
      !read_int64s(lse_sizes, record->lse_sizes, "lse_sizes") ||
      !read_int64s(lse_strides, record->lse_strides, "lse_strides")) {
    return nullptr;
  }
  record->function = reinterpret_cast<void*>(function);
  record->smem = smem;
  record->device = device;
  record->unread_lse = THPVariable_Unpack(unread_lse);
  record->params.resize(record->param_offsets.size());
  auto* bytes = reinterpret_cast<unsigned char*>(record->buffer.data());
  for (size_t i = 0; i < record->params.size(); ++i) record->params[i] = bytes + record->param_offsets[i];
  Py_INCREF(entry);
  record->entry = entry;
  record->plans = PyDict_GetItemWithError(plans_namespace, plans_name);
  if (record->plans == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "register: tileattn.api has no _plans");
    return nullptr;
  }
  Py_INCREF(record->plans);
  if (records.size() >= kMaxRecords) records.clear();
  records[key] = std::move(record);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// ---- configure(launch_kernel, stream_is_capturing, stream_counters, launch_error, api_namespace,
//                device_type="cuda") ---------------------------------------------------------------------
PyObject* configure(PyObject*, PyObject* args) {
  unsigned long long launch_address, capturing_address;
  PyObject *counters, *error, *namespace_;
  const char* device_type = "cuda";
  if (!PyArg_ParseTuple(args, "KKOOO!|s:configure", &launch_address, &capturing_address, &counters, &error,
                        &PyDict_Type, &namespace_, &device_type)) {
    return nullptr;
  }
  const bool cpu = std::strcmp(device_type, "cpu") == 0;
  if (!cpu && std::strcmp(device_type, "cuda") != 0) {
    PyErr_Format(PyExc_ValueError, "configure: device_type must be 'cuda' or 'cpu' (tests), got '%s'", device_type);
    return nullptr;
  }
  if (launch_address == 0 || capturing_address == 0 || !PyCallable_Check(counters) || !PyExceptionClass_Check(error)) {
    PyErr_SetString(PyExc_ValueError, "configure: two driver entry points, a callable and an exception class");
    return nullptr;
  }
  if (plans_name == nullptr && (plans_name = PyUnicode_InternFromString("_plans")) == nullptr) return nullptr;
  records.clear();  // records of an earlier configuration point at its namespace
  served_type = cpu ? c10::DeviceType::CPU : c10::DeviceType::CUDA;
  Py_INCREF(namespace_);
  Py_XSETREF(plans_namespace, namespace_);
  launch_kernel = reinterpret_cast<LaunchKernelFn>(launch_address);
  stream_is_capturing = reinterpret_cast<StreamIsCapturingFn>(capturing_address);
  Py_INCREF(counters);
  Py_XSETREF(stream_counters, counters);
  Py_INCREF(error);
  Py_XSETREF(launch_error, error);
  Py_RETURN_NONE;
}

PyObject* set_poison(PyObject*, PyObject* flag) {
  const int on = PyObject_IsTrue(flag);
  if (on < 0) return nullptr;
  poison_outputs = on != 0;
  Py_RETURN_NONE;
}

PyObject* clear(PyObject*, PyObject*) {
  records.clear();
  Py_RETURN_NONE;
}

PyObject* record_count(PyObject*, PyObject*) { return PyLong_FromSize_t(records.size()); }

PyObject* mark_exiting(PyObject*, PyObject*) {
  interpreter_exiting = true;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"forward", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(forward)), METH_FASTCALL,
     "forward(q, k, v, causal, scale, want, deterministic=False): out (want 0), (out, lse) (1), (out, lse, entry) "
     "(2) or (out, lse) with autograd (3) for a registered combination, launched on torch's current stream; None "
     "when the call is not one"},
    {"register", register_record, METH_VARARGS,
     "register(q, k, v, causal, scale, entry, function, device, grid, block, smem, buffer, offsets, slots, "
     "out_sizes, out_strides, lse_sizes, lse_strides, unread_lse): a planned combination"},
    {"configure", configure, METH_VARARGS,
     "set the driver entry points, stream_counters, LaunchError and tileattn.api's namespace"},
    {"clear", clear, METH_NOARGS, "drop every record"},
    {"set_poison", set_poison, METH_O, "tests: fill every output with NaN before its launch (True) or not"},
    {"record_count", record_count, METH_NOARGS, "how many combinations are registered"},
    {"_mark_exiting", mark_exiting, METH_NOARGS, "atexit hook: from now on graphs freed keep their entry reference"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_host_launch", "tileattn's compiled forward path", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__host_launch(void) {
  PyObject* created = PyModule_Create(&module);
  if (created == nullptr) return nullptr;
  // atexit.register(_mark_exiting)
  PyObject* atexit = PyImport_ImportModule("atexit");
  PyObject* hook = atexit == nullptr ? nullptr : PyObject_GetAttrString(created, "_mark_exiting");
  PyObject* done = hook == nullptr ? nullptr : PyObject_CallMethod(atexit, "register", "O", hook);
  Py_XDECREF(atexit);
  Py_XDECREF(hook);
  if (done == nullptr) {
    Py_DECREF(created);
    return nullptr;
  }
  Py_DECREF(done);
  return created;
}
