// The eager attention's host work in compiled calls (issue #9, docs/runtime.md "The compiled
// forward and backward path").
//
// tileattn.attention(q, k, v) spends its host time in Python: the plan key (shapes, strides,
// dtypes, devices, flags), torch allocations, the current stream, the tensor-map and tile-counter
// lookups, and cuda.bindings' cuLaunchKernel wrapper; its backward the same for three launches. This
// module does those steps for a combination the Python path has already validated and planned:
//
//   forward(q, k, v, causal, scale, want, deterministic=False)
//       -> out (want 0) | (out, lse) (1) | (out, lse, entry) (2) | (out, lse) (3) | out (4) | None
//          (3 and 4, tileattn.attention's: out gets an autograd node when grad mode is on and an input
//          requires grad)
//   backward(q, k, v, out, lse, dout, causal, scale, deterministic) -> (dq, dk, dv) | None
//
// forward builds the key from the tensors, finds the record that tileattn.api registered for it
// (the LaunchPlan's packed parameter buffer, which parameters change per call, and the output
// specs), allocates out (and lse) with ATen, fills in the data pointers and tensor maps, and calls
// cuLaunchKernel on torch's current stream. With want 3 or 4 and an input that requires grad, out
// gets an autograd node (AttentionBackward); its backward finds the record again from the saved
// tensors and runs its backward launches for dout's layout and the deterministic flag (registered by
// tileattn.api._backward after its first Python-path backward of that layout), and otherwise calls
// tileattn.api._backward_of_saved. backward() is the same backward without autograd
// (benchmarks and tests). None means "not mine": no record, another current device, a misaligned
// pointer, a stream under capture with a persistent grid, an argument of an unexpected type, a
// dispatch mode, a forward-mode tangent, a torch.func transform. The caller then takes the Python
// path, which checks everything and raises the errors. Nothing here validates more than that: a record
// exists only for a key the Python path accepted, and the key holds everything that path checks except
// the data pointers' alignment.
//
// It launches the plans' own kernels with the plans' own packed bytes, so it is the Python
// LaunchPlan's launch done in C++, not a second way of setting up a kernel. The driver entry points
// come from cuGetProcAddress (through cuda.bindings, in Python), so no CUDA header or library is
// needed to build it: a C++17 compiler, Python's headers and torch's.
//
// Thread safety: everything runs under the GIL (the autograd backward, on torch's device thread,
// takes it first). The only calls back into Python (a tensor map's encoder on a new address, the
// stream's tile-counter pair on a new stream) happen before any byte of a shared parameter buffer
// is written, so another thread that runs while they hold the GIL cannot interleave with a launch.

#include <Python.h>

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <unordered_map>
#include <utility>
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
bool poison_outputs = false;          // tests: fill outputs and workspaces with NaN before the launch

constexpr size_t kMaxRecords = 8192;  // start over beyond this (tileattn.api clears at 4096 plans first)
constexpr size_t kMaxMapsPerSlot = 64;  // encoded tensor maps kept per slot (per address)
constexpr size_t kMaxBackwardPerRecord = 8;  // (dout layout, deterministic) pairs kept per record
constexpr int kMaxTensorMaps = 8;  // per launch
constexpr size_t kMaxBackwardLaunches = 4;

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

static_assert(sizeof(Key) % 8 == 0, "KeyHash reads the key as 64-bit words");

struct KeyHash {
  size_t operator()(const Key& key) const {
    // Over the key's 26 64-bit words (the struct is memset to 0 first, so padding is deterministic), four
    // independent multiply-xor lanes, then splitmix64's finalizer. (Byte-wise FNV-1a was one chain of 208
    // dependent multiplies: 22 % of a forward call's CPU time in `perf` on the CPU machine.)
    uint64_t words[sizeof(Key) / 8];
    std::memcpy(words, &key, sizeof(Key));
    uint64_t lanes[4] = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull, 0x27D4EB2F165667C5ull};
    for (size_t i = 0; i < sizeof(Key) / 8; ++i) lanes[i % 4] = (lanes[i % 4] ^ words[i]) * 0x100000001B3ull;
    uint64_t h = lanes[0] ^ (lanes[1] << 1 | lanes[1] >> 63) ^ (lanes[2] << 2 | lanes[2] >> 62) ^
                 (lanes[3] << 3 | lanes[3] >> 61);
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    return static_cast<size_t>(h ^ (h >> 31));
  }
};

// ---- one planned kernel launch ----------------------------------------------------------------------
// A slot is a parameter whose value changes per call: a data pointer (plus a byte offset), a
// tensor map of a source tensor, or the stream's tile-counter pair. Sources: the call's tensors and
// the backward's workspaces, in the order runtime/host_launch.py names them.
enum SlotKind : int { kPointer = 0, kTensorMap = 1, kTileCounter = 2 };
enum Source : int { kQ, kK, kV, kOut, kLse, kDout, kDq, kDk, kDv, kWorkspace, kSemaphores, kNull, kSources };
constexpr int kForwardSources = kLse + 1;  // a forward's slots read q, k, v, out, lse only

struct alignas(64) MapBytes {
  unsigned char bytes[128];  // one CUtensorMap
};

struct Slot {
  int kind;
  int param;           // kernel parameter index
  int source;          // kPointer / kTensorMap: a Source
  int64_t offset = 0;  // kPointer: bytes added to the source's address (a workspace's parts)
  PyObject* encode = nullptr;  // kTensorMap: TensorMapTemplate.encode (owned by the Launch)
  std::unordered_map<uint64_t, MapBytes> maps;  // kTensorMap: encoded maps by address
};

// One kernel, its geometry and its packed parameters: a LaunchPlan as runtime.host_launch sees it.
struct Launch {
  void* function = nullptr;
  unsigned grid[3], block[3], smem;
  std::vector<uint64_t> buffer;        // the packed parameters, 8-byte aligned
  std::vector<size_t> param_offsets;   // byte offset of each kernel parameter in buffer
  std::vector<void*> params;           // cuLaunchKernel's kernelParams: into buffer, or a map's bytes
  std::vector<Slot> slots;
  std::unordered_map<void*, uint64_t> counters;  // stream -> its tile-counter pair's address

  ~Launch() {
    for (Slot& slot : slots) Py_XDECREF(slot.encode);
  }
};

// What a launch needs that may come from Python: its tensor maps (copied out of the per-slot caches,
// since a later callback may clear a cache) and the tile-counter pair.
struct Prepared {
  MapBytes maps[kMaxTensorMaps];
  uint64_t counter = 0;
};

// The backward of one forward record for one (dout layout, deterministic) pair: its launches in
// order, the gradients' specs, and the workspaces' sizes (fp32 elements; int32 semaphores zeroed
// per call, none when 0).
struct BackwardRecord {
  int64_t dout_strides[4];
  int8_t dout_dtype;
  bool deterministic;
  std::vector<std::unique_ptr<Launch>> launches;
  std::vector<int64_t> grad_sizes[3], grad_strides[3];
  int64_t grad_offsets[3] = {0, 0, 0};  // elements: dq, dk, dv share one allocation (run_backward)
  int64_t grad_storage_elems = 0;
  int64_t workspace_elems = 0, semaphore_elems = 0;
};

// dq, dk and dv start at multiples of 128 elements (256 bytes for fp16 / bf16) of their shared
// allocation: the kernels' 16-byte vector accesses and tensor maps need 16, the caching allocator
// itself hands out 512-byte aligned blocks.
constexpr int64_t kGradAlignElems = 128;

// ---- a record: one planned combination ---------------------------------------------------------------
struct Record {
  PyObject* entry = nullptr;  // tileattn.api._PlanEntry (owned reference), returned with want == 2
  PyObject* plans = nullptr;  // the tileattn.api._plans dict the entry was made for (owned reference)
  int device;
  std::unique_ptr<Launch> forward;
  std::vector<int64_t> out_sizes, out_strides, lse_sizes, lse_strides;
  at::Tensor unread_lse;  // lse's target when the caller does not want it
  std::vector<std::shared_ptr<BackwardRecord>> backward;

  ~Record() {
    Py_XDECREF(entry);
    Py_XDECREF(plans);
  }
};

// Never destroyed: at process exit the interpreter (whose references the records hold) is gone.
std::unordered_map<Key, std::shared_ptr<Record>, KeyHash>& records =
    *new std::unordered_map<Key, std::shared_ptr<Record>, KeyHash>();

// Fills `key` from q, k, v and the flags; false when the tensors are not a combination a record
// could hold (not of the served device type, rank 4 and strided).
bool key_of(const at::Tensor* const* qkv, bool causal, bool has_scale, double scale, Key& key) {
  std::memset(&key, 0, sizeof(Key));
  for (int i = 0; i < 3; ++i) {
    const at::Tensor& t = *qkv[i];
    if (t.dim() != 4 || t.layout() != c10::kStrided || t.device().type() != served_type) return false;
    for (int d = 0; d < 4; ++d) {
      key.shape_strides[i][d] = t.size(d);
      key.shape_strides[i][4 + d] = t.stride(d);
    }
    key.dtype[i] = static_cast<int8_t>(t.scalar_type());
    key.device[i] = static_cast<int8_t>(t.get_device());
  }
  key.causal = causal;
  key.has_scale = has_scale;
  key.scale = has_scale ? scale : 0.0;
  return true;
}

// The same from the call's Python arguments; false also when they are not plain tensors, causal is
// not a bool or scale neither None nor a float.
bool make_key(PyObject* const* tensors, PyObject* causal, PyObject* scale, Key& key) {
  const at::Tensor* qkv[3];
  for (int i = 0; i < 3; ++i) {
    if (!THPVariable_CheckExact(tensors[i])) return false;
    qkv[i] = &THPVariable_Unpack(tensors[i]);
  }
  if ((causal != Py_True && causal != Py_False) || (scale != Py_None && !PyFloat_CheckExact(scale))) return false;
  return key_of(qkv, causal == Py_True, scale != Py_None, scale == Py_None ? 0.0 : PyFloat_AS_DOUBLE(scale), key);
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

// Reads (sizes, strides) into the two vectors; false with a Python error set.
bool read_spec(PyObject* spec, std::vector<int64_t>& sizes, std::vector<int64_t>& strides, const char* what) {
  PyObject* fast = PySequence_Fast(spec, what);
  if (fast == nullptr) return false;
  const bool ok = PySequence_Fast_GET_SIZE(fast) == 2 && read_int64s(PySequence_Fast_GET_ITEM(fast, 0), sizes, what) &&
                  read_int64s(PySequence_Fast_GET_ITEM(fast, 1), strides, what) && sizes.size() == strides.size();
  Py_DECREF(fast);
  if (!ok && !PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "register: %s must be (sizes, strides)", what);
  return ok;
}

uint64_t call_for_uint64(PyObject* callable, PyObject* argument) {
  // callable(argument) as an unsigned 64-bit int (0 with a Python exception set on failure).
  PyObject* result = PyObject_CallOneArg(callable, argument);
  if (result == nullptr) return 0;
  const uint64_t value = PyLong_AsUnsignedLongLong(result);
  Py_DECREF(result);
  return (value == static_cast<uint64_t>(-1) && PyErr_Occurred()) ? 0 : value;
}

[[noreturn]] void throw_python_error() {
  python_error error;  // torch/csrc/Exceptions.h (global namespace)
  error.persist();  // the current Python exception, re-raised where the C++ exception is caught
  throw error;
}

// Parses one launch: (function, grid, block, smem, buffer, param_layout, slots), param_layout a
// (byte offset, size) pair per kernel parameter, each slot (kind, param, source, encode[, offset])
// with sources below `sources`: pointers and the tile counter at 8-byte parameters, maps at 128-byte
// ones, and every 128-byte parameter a map slot (the buffer holds no bytes of a tensor map: one
// without a slot would be launched as zeros). nullptr with a Python error set when it is malformed.
std::unique_ptr<Launch> parse_launch(PyObject* description, int sources) {
  unsigned long long function;
  unsigned int smem;
  PyObject *grid, *block, *param_layout, *slots;
  Py_buffer buffer;
  if (!PyArg_ParseTuple(description, "KOOIy*OO:launch", &function, &grid, &block, &smem, &buffer, &param_layout, &slots)) {
    return nullptr;
  }
  auto launch = std::make_unique<Launch>();
  launch->buffer.resize((buffer.len + 7) / 8 + 1, 0);
  std::memcpy(launch->buffer.data(), buffer.buf, buffer.len);
  const size_t buffer_bytes = static_cast<size_t>(buffer.len);
  PyBuffer_Release(&buffer);
  launch->function = reinterpret_cast<void*>(function);
  launch->smem = smem;
  std::vector<int64_t> geometry;
  for (auto [sequence, target, what] : {std::make_tuple(grid, launch->grid, "grid"),
                                        std::make_tuple(block, launch->block, "block")}) {
    if (!read_int64s(sequence, geometry, what) || geometry.size() != 3) {
      if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "register: %s must have 3 entries", what);
      return nullptr;
    }
    for (int i = 0; i < 3; ++i) target[i] = static_cast<unsigned>(geometry[i]);
  }
  std::vector<int64_t> param_sizes;
  PyObject* layout = PySequence_Fast(param_layout, "param_layout");
  if (layout == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(layout); ++i) {
    std::vector<int64_t> pair;
    if (!read_int64s(PySequence_Fast_GET_ITEM(layout, i), pair, "param_layout") || pair.size() != 2) {
      Py_DECREF(layout);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "register: param_layout holds (offset, size) pairs");
      return nullptr;
    }
    const int64_t offset = pair[0], size = pair[1];
    if (offset < 0 || size < 1 || static_cast<size_t>(offset + size) > buffer_bytes) {
      Py_DECREF(layout);
      PyErr_Format(PyExc_ValueError, "register: parameter %zd (offset %lld, %lld bytes) outside the %zu-byte buffer",
                   i, static_cast<long long>(offset), static_cast<long long>(size), buffer_bytes);
      return nullptr;
    }
    launch->param_offsets.push_back(static_cast<size_t>(offset));
    param_sizes.push_back(size);
  }
  Py_DECREF(layout);
  PyObject* fast = PySequence_Fast(slots, "slots");
  if (fast == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    Slot slot;
    PyObject* encode = Py_None;
    long long offset = 0;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "iiiO|L:slot", &slot.kind, &slot.param, &slot.source,
                          &encode, &offset)) {
      Py_DECREF(fast);
      return nullptr;
    }
    slot.offset = offset;
    const bool in_range = slot.param >= 0 && static_cast<size_t>(slot.param) < launch->param_offsets.size();
    const bool valid = slot.kind >= kPointer && slot.kind <= kTileCounter && in_range &&
                       (slot.kind == kTileCounter || (slot.source >= 0 && slot.source < sources)) &&
                       (slot.kind != kTensorMap || (PyCallable_Check(encode) && slot.source != kWorkspace &&
                                                    slot.source != kSemaphores && slot.source != kNull &&
                                                    param_sizes[slot.param] == 128)) &&
                       (slot.kind == kPointer || offset == 0) && offset >= 0 &&
                       (slot.kind == kTensorMap ||
                        (param_sizes[slot.param] == 8 && launch->param_offsets[slot.param] % 8 == 0));
    if (!valid) {
      Py_DECREF(fast);
      PyErr_Format(PyExc_ValueError, "register: slot %zd is malformed", i);
      return nullptr;
    }
    if (slot.kind == kTensorMap) {
      Py_INCREF(encode);
      slot.encode = encode;
    }
    launch->slots.push_back(std::move(slot));
  }
  Py_DECREF(fast);
  size_t map_slots = 0;
  std::vector<bool> mapped(param_sizes.size(), false);
  for (const Slot& slot : launch->slots) {
    map_slots += slot.kind == kTensorMap;
    if (slot.kind == kTensorMap) mapped[slot.param] = true;
  }
  if (map_slots > kMaxTensorMaps) {
    PyErr_Format(PyExc_ValueError, "register: %zu tensor-map slots, at most %d", map_slots, kMaxTensorMaps);
    return nullptr;
  }
  for (size_t i = 0; i < param_sizes.size(); ++i) {
    if (param_sizes[i] == 128 && !mapped[i]) {
      PyErr_Format(PyExc_ValueError, "register: parameter %zu is a 128-byte tensor map without a tensor-map slot", i);
      return nullptr;
    }
  }
  launch->params.resize(launch->param_offsets.size());
  auto* bytes = reinterpret_cast<unsigned char*>(launch->buffer.data());
  for (size_t i = 0; i < launch->params.size(); ++i) launch->params[i] = bytes + launch->param_offsets[i];
  return launch;
}

// The tensor maps and the tile-counter pair of `launch` for these source addresses (may call back
// into Python: an encoder for a new address, stream_counters for a new stream; their errors are
// thrown as torch::python_error).
void prepare(Launch& launch, int device, void* stream, const uint64_t* sources, Prepared& prepared) {
  int map_count = 0;
  for (Slot& slot : launch.slots) {
    if (slot.kind == kTileCounter) {
      auto hit = launch.counters.find(stream);
      if (hit == launch.counters.end()) {
        PyObject* index = PyLong_FromLong(device);
        if (index == nullptr) throw_python_error();
        const uint64_t counter = call_for_uint64(stream_counters, index);
        Py_DECREF(index);
        if (PyErr_Occurred()) throw_python_error();
        hit = launch.counters.emplace(stream, counter).first;
      }
      prepared.counter = hit->second;
    } else if (slot.kind == kTensorMap) {
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
        prepared.maps[map_count++] = hit->second;
        Py_DECREF(tmap);  // after the copies: the map's bytes live as long as the TensorMap
        continue;
      }
      prepared.maps[map_count++] = hit->second;
    }
  }
}

// Writes the call's values into the launch's buffer and launches (no Python code runs here: the
// GIL is held from the first write until cuLaunchKernel has copied the parameters). A driver error
// is thrown as runtime.LaunchError.
void fire(Launch& launch, void* stream, const uint64_t* sources, const Prepared& prepared, const char* what) {
  auto* bytes = reinterpret_cast<unsigned char*>(launch.buffer.data());
  int map_count = 0;
  for (const Slot& slot : launch.slots) {
    if (slot.kind == kTensorMap) {
      launch.params[slot.param] = const_cast<unsigned char*>(prepared.maps[map_count++].bytes);  // the driver copies them
    } else {
      const uint64_t value = slot.kind == kTileCounter ? prepared.counter
                             : slot.source == kNull    ? 0
                                                       : sources[slot.source] + static_cast<uint64_t>(slot.offset);
      std::memcpy(bytes + launch.param_offsets[slot.param], &value, sizeof(value));
    }
  }
  const CUresult err = launch_kernel(launch.function, launch.grid[0], launch.grid[1], launch.grid[2], launch.block[0],
                                     launch.block[1], launch.block[2], launch.smem, stream, launch.params.data(),
                                     nullptr);
  if (err != 0) {
    PyErr_Format(launch_error, "cuLaunchKernel (compiled %s path) failed: CUresult %d, grid (%u, %u, %u), "
                 "block (%u, %u, %u), smem %u", what, err, launch.grid[0], launch.grid[1], launch.grid[2],
                 launch.block[0], launch.block[1], launch.block[2], launch.smem);
    throw_python_error();
  }
}

uint64_t address_of(const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

// The current stream of `device` when it is the current device (cuLaunchKernel uses the thread's
// current context: the module launches only on the record's device); false otherwise.
bool current_stream(int device, void*& stream) {
  stream = nullptr;
  if (served_type != c10::DeviceType::CUDA) return true;
  const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const c10::Device current = cuda->getDevice();
  if (current.index() != device) return false;
  stream = cuda->getStream(current).native_handle();
  return true;
}

// ---- the forward ------------------------------------------------------------------------------------
// A call the module serves: its record, the current stream and the operands' data pointers.
struct Call {
  std::shared_ptr<Record> record;  // alive even if a callback clears `records`
  Key key;
  void* stream = nullptr;
  uint64_t qkv[3] = {0, 0, 0};
  at::Tensor lse;  // with autograd: the forward's lse, handed back beside the node's one output
  int capturing = -1;  // whether `stream` is capturing a graph (a query failure counts as yes); -1: not asked yet

  // One driver query per call at most (a persistent grid's counter and an unread-lse forward both ask).
  bool stream_capturing() {
    if (capturing < 0) {
      int status = 0;
      capturing = stream_is_capturing(stream, &status) != 0 || status != 0;
    }
    return capturing != 0;
  }
};

// The record of `key` while tileattn.api's plan cache is the one it was made for (a test's
// monkeypatch replaces it: then its entries are not the records' entries); nullptr when there is
// none. Nothing here calls back into Python.
std::shared_ptr<Record> find_record(const Key& key) {
  auto found = records.find(key);
  if (found == records.end()) return nullptr;
  if (PyDict_GetItemWithError(plans_namespace, plans_name) != found->second->plans) return nullptr;
  return found->second;
}

std::shared_ptr<Record> find_record(PyObject* const* qkv, PyObject* causal, PyObject* scale) {
  Key key;
  return make_key(qkv, causal, scale, key) ? find_record(key) : nullptr;
}

// Whether the module serves this forward (fills `call`); false with a Python error set on failure,
// false without one for a call it leaves to the Python path. Nothing here calls back into Python.
bool find_call(PyObject* const* args, Call& call) {
  if (!make_key(args, args[3], args[4], call.key)) return false;
  std::shared_ptr<Record> record = find_record(call.key);
  if (record == nullptr) return false;
  for (int i = 0; i < 3; ++i) call.qkv[i] = address_of(THPVariable_Unpack(args[i]));
  if ((call.qkv[0] | call.qkv[1] | call.qkv[2]) & 15) return false;  // the Python path raises the alignment error
  if (!current_stream(record->device, call.stream)) return false;
  for (const Slot& slot : record->forward->slots) {
    // Under capture the graph needs a counter pair of its own (runtime.stream_counters).
    if (slot.kind == kTileCounter && call.stream_capturing()) return false;
  }
  call.record = std::move(record);
  return true;
}

void poison(const at::Tensor& t) { t.fill_(std::numeric_limits<double>::quiet_NaN()); }

// A tensor of `dtype` over part of `block`'s storage (offset in elements of `dtype`): a plain tensor
// sharing the storage, not an autograd view, so that autograd keeps it as it is (as .grad, as an output).
at::Tensor part_of(const at::Tensor& block, c10::ScalarType dtype, at::IntArrayRef sizes, at::IntArrayRef strides,
                   int64_t offset) {
  auto part = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(block.storage()),
                                                   block.key_set(), c10::scalarTypeToTypeMeta(dtype));
  part->set_sizes_and_strides(sizes, strides, offset);
  return at::Tensor(std::move(part));
}

// Elements from a tensor's first to its last element (sizes >= 1), plus one.
int64_t span_of(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  int64_t span = 1;
  for (size_t d = 0; d < sizes.size(); ++d) span += (sizes[d] - 1) * strides[d];
  return span;
}

// Allocates out (and a fresh lse, or the record's unread buffer) and launches. Python errors (from a
// tensor map's encoder, the counter lookup, the driver) are thrown as torch::python_error.
// With `one_block` (the autograd node's forward, whose out and lse live as long as each other until the
// backward) both come from one allocation, lse after out at a 256-byte boundary: one trip through the
// caching allocator fewer (~1.5 us on the H100 hosts); lse's bytes (2 / d of out's at 16 bits) then stay
// allocated as long as out does.
void launch_forward(Call& call, const at::Tensor& q, bool fresh_lse, at::Tensor& out, at::Tensor& lse,
                    bool one_block = false) {
  Record& record = *call.record;
  if (one_block) {
    const int64_t out_bytes = span_of(record.out_sizes, record.out_strides) * q.element_size();
    const int64_t lse_offset_bytes = (out_bytes + 255) / 256 * 256;
    const int64_t lse_bytes = span_of(record.lse_sizes, record.lse_strides) * 4;
    const at::Tensor block = at::empty({lse_offset_bytes + lse_bytes}, q.options().dtype(at::kByte));
    out = part_of(block, q.scalar_type(), record.out_sizes, record.out_strides, 0);
    lse = part_of(block, at::kFloat, record.lse_sizes, record.lse_strides, lse_offset_bytes / 4);
  } else {
    out = at::empty_strided(record.out_sizes, record.out_strides, q.options());
    // Under stream capture the graph writes lse on every replay: into memory of its own pool, not the
    // record's buffer, which tileattn.api.clear_plans may free while the graph lives.
    if (!fresh_lse && call.stream_capturing()) fresh_lse = true;
    lse = fresh_lse ? at::empty_strided(record.lse_sizes, record.lse_strides, q.options().dtype(at::kFloat))
                    : record.unread_lse;
  }
  if (poison_outputs) {  // as the GPU tests' poisoned_allocations() does on the Python path
    poison(out);
    poison(lse);
  }
  uint64_t sources[kSources] = {call.qkv[0], call.qkv[1], call.qkv[2], address_of(out), address_of(lse)};
  Prepared prepared;
  prepare(*record.forward, record.device, call.stream, sources, prepared);
  fire(*record.forward, call.stream, sources, prepared, "forward");
}

// ---- the backward -----------------------------------------------------------------------------------
// The backward record of `record` for this dout and mode, or nullptr (not registered, or a dout the
// plans were not made for: another layout, dtype or device, a misaligned address).
std::shared_ptr<BackwardRecord> find_backward(const Record& record, const at::Tensor& dout, bool deterministic) {
  if (dout.dim() != 4 || dout.layout() != c10::kStrided || dout.device().type() != served_type ||
      dout.get_device() != record.device || (address_of(dout) & 15) != 0) {
    return nullptr;
  }
  for (int d = 0; d < 4; ++d) {
    if (dout.size(d) != record.out_sizes[d]) return nullptr;
  }
  for (const std::shared_ptr<BackwardRecord>& backward : record.backward) {
    if (backward->deterministic != deterministic || backward->dout_dtype != static_cast<int8_t>(dout.scalar_type())) {
      continue;
    }
    bool same = true;
    for (int d = 0; d < 4; ++d) same = same && backward->dout_strides[d] == dout.stride(d);
    if (same) return backward;
  }
  return nullptr;
}

// Whether `t` has these sizes, strides and dtype on the record's device, at a 16-byte aligned address.
bool laid_out_as(const at::Tensor& t, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                 at::ScalarType dtype, int device) {
  return t.layout() == c10::kStrided && t.device().type() == served_type && t.get_device() == device &&
         t.scalar_type() == dtype && t.sizes() == c10::IntArrayRef(sizes) && t.strides() == c10::IntArrayRef(strides) &&
         (address_of(t) & 15) == 0;
}

// The record and backward record that serve a backward of these tensors (q, k, v as `key` says;
// out and lse as the record's forward makes them; every address 16-byte aligned) on the current
// stream of the record's device; false for one the Python path takes (not registered, or tensors
// that a saved-tensor hook returned in another layout).
struct BackwardCall {
  std::shared_ptr<Record> record;
  std::shared_ptr<BackwardRecord> backward;
  void* stream = nullptr;
};

bool find_backward_call(const Key& key, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout, bool deterministic,
                        BackwardCall& call) {
  call.record = find_record(key);
  if (call.record == nullptr) return false;
  const Record& record = *call.record;
  if (!laid_out_as(out, record.out_sizes, record.out_strides, q.scalar_type(), record.device) ||
      !laid_out_as(lse, record.lse_sizes, record.lse_strides, at::kFloat, record.device) ||
      ((address_of(q) | address_of(k) | address_of(v)) & 15)) {
    return false;
  }
  call.backward = find_backward(record, dout, deterministic);
  return call.backward != nullptr && current_stream(record.device, call.stream);
}

// (dq, dk, dv) from the backward record's launches: allocates the gradients and workspaces with
// ATen, prepares every launch's maps, then launches them in order on `stream`.
torch::autograd::variable_list run_backward(const Record& record, BackwardRecord& backward, void* stream,
                                            const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout) {
  // One allocation for the three gradients, each a tensor over its part of that storage (not an autograd
  // view: a plain tensor sharing the storage, which AccumulateGrad keeps as .grad as it is): two fewer
  // trips through the caching allocator per backward (an ATen allocation with its Python wrap: 1.93 us in the
  // H200 machine's probe of session 36, docs/runtime.md).
  const at::Tensor grad_storage = at::empty({backward.grad_storage_elems}, q.options());
  torch::autograd::variable_list grads(3);
  for (int i = 0; i < 3; ++i) {
    grads[i] = part_of(grad_storage, q.scalar_type(), backward.grad_sizes[i], backward.grad_strides[i],
                       backward.grad_offsets[i]);
  }
  at::Tensor workspace = at::empty({backward.workspace_elems}, q.options().dtype(at::kFloat));
  at::Tensor semaphores;
  if (backward.semaphore_elems > 0) semaphores = at::zeros({backward.semaphore_elems}, q.options().dtype(at::kInt));
  if (poison_outputs) {
    for (const at::Tensor& grad : grads) poison(grad);
    poison(workspace);
  }
  const uint64_t sources[kSources] = {
      address_of(q),        address_of(k),        address_of(v),        address_of(out),
      address_of(lse),      address_of(dout),     address_of(grads[0]), address_of(grads[1]),
      address_of(grads[2]), address_of(workspace), semaphores.defined() ? address_of(semaphores) : 0, 0};
  Prepared prepared[kMaxBackwardLaunches];
  for (size_t i = 0; i < backward.launches.size(); ++i) {
    prepare(*backward.launches[i], record.device, stream, sources, prepared[i]);
  }
  for (size_t i = 0; i < backward.launches.size(); ++i) {
    fire(*backward.launches[i], stream, sources, prepared[i], "backward");
  }
  return grads;  // the workspaces return to torch's caching allocator, for work enqueued after these kernels
}

// ---- autograd: the forward through the compiled path, the backward through its backward records or
// tileattn.api._backward_of_saved ---------------------------------------------------------------------
// The node saves q, k, v, out, lse and, as plain values, the key's flags (causal, whether a scale
// was given, the scale) and the mode; its backward finds the record again from the saved tensors,
// so tensors that a saved-tensor hook returned in another layout are never run with launches
// planned for the old one, and the node holds no Python object (compiled autograd lifts its saved
// values, which must be hashable).

// The Python backward of a call the module does not serve: tileattn.api._backward_of_saved(dout, q,
// k, v, out, lse, causal, scale, deterministic) -> (dq, dk, dv), which plans (and registers) it.
torch::autograd::variable_list python_backward(const at::Tensor& dout, const torch::autograd::variable_list& saved,
                                               const Key& key, bool deterministic) {
  PyObject* backward_fn = PyDict_GetItemString(plans_namespace, "_backward_of_saved");
  if (backward_fn == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "host_launch: tileattn.api has no _backward_of_saved");
    throw_python_error();
  }
  PyObject* scale = key.has_scale ? PyFloat_FromDouble(key.scale) : (Py_INCREF(Py_None), Py_None);
  if (scale == nullptr) throw_python_error();
  PyObject* call_args = Py_BuildValue("(NNNNNNONO)", THPVariable_Wrap(dout), THPVariable_Wrap(saved[0]),
                                      THPVariable_Wrap(saved[1]), THPVariable_Wrap(saved[2]),
                                      THPVariable_Wrap(saved[3]), THPVariable_Wrap(saved[4]),
                                      key.causal ? Py_True : Py_False, scale, deterministic ? Py_True : Py_False);
  if (call_args == nullptr) throw_python_error();
  PyObject* result = PyObject_Call(backward_fn, call_args, nullptr);
  Py_DECREF(call_args);
  if (result == nullptr) throw_python_error();
  torch::autograd::variable_list grads(3);
  const bool triple = PyTuple_Check(result) && PyTuple_GET_SIZE(result) == 3;
  for (int i = 0; triple && i < 3; ++i) {
    PyObject* item = PyTuple_GET_ITEM(result, i);
    if (!THPVariable_Check(item)) break;
    grads[i] = THPVariable_Unpack(item);
  }
  Py_DECREF(result);
  if (!triple || !grads[0].defined() || !grads[1].defined() || !grads[2].defined()) {
    PyErr_SetString(PyExc_RuntimeError, "host_launch: tileattn.api._backward_of_saved must return (dq, dk, dv) tensors");
    throw_python_error();
  }
  return grads;
}

// The node's plain values: flags (bit 0 causal, bit 1 a scale was given, bit 2 deterministic) and the scale.
constexpr int64_t kCausal = 1, kHasScale = 2, kDeterministic = 4;

// (dq, dk, dv) for dout from the saved q, k, v, out, lse: the registered launches of the record the
// saved tensors key, or tileattn.api._backward_of_saved for a dout layout or mode not registered yet
// (and for saved tensors in another layout, as a saved-tensor hook may return them).
torch::autograd::variable_list attention_backward(const at::Tensor& dout, const torch::autograd::variable_list& saved,
                                                  int64_t flags, double scale) {
  // torch.use_deterministic_algorithms(True) selects the deterministic mode too (read when the backward runs,
  // as torch's own backwards read it; tileattn.api._backward does the same).
  const bool deterministic = (flags & kDeterministic) != 0 || at::globalContext().deterministicAlgorithms();
  const at::Tensor* qkv[3] = {&saved[0], &saved[1], &saved[2]};
  Key key;
  const bool keyed = key_of(qkv, (flags & kCausal) != 0, (flags & kHasScale) != 0, scale, key);
  pybind11::gil_scoped_acquire gil;
  BackwardCall call;
  return keyed && find_backward_call(key, saved[0], saved[1], saved[2], saved[3], saved[4], dout, deterministic, call)
             ? run_backward(*call.record, *call.backward, call.stream, saved[0], saved[1], saved[2], saved[3],
                            saved[4], dout)
             : python_backward(dout, saved, key, deterministic);
}

// The autograd node of a with-grad forward, written as torch's generated nodes are (saved variables as
// members, no AutogradContext): a torch::autograd::Function's node costs a fifth more to build and free
// in this module's CPU measurement (docs/runtime.md), its context's hash map, variable lists and input
// and output info included. Edges to q, k, v; out saved through tensor_data() (a shallow copy without
// autograd metadata that shares out's version counter, so an in-place change of out before the backward
// is still caught, and no reference from the node back to out's own grad_fn; detach() would cost a trip
// through the dispatcher). Compiled autograd: compiled_args and apply_with_saved do
// what torch's C++ Function node does (CppNode in torch/csrc/autograd/custom_function.h, the same in
// torch 2.11 and 2.13): the saved tensors and values go into the graph's cache key, and the backward
// runs as an opaque call (apply_functional) of the compiled graph.
struct AttentionBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable q_, k_, v_, out_, lse_;
  int64_t flags_ = 0;
  double scale_ = 0.0;

  std::string name() const override { return "tileattn::AttentionBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);  // as torch's C++ Function nodes: apply may run on several threads
    if (!grads[0].defined()) return torch::autograd::variable_list(3);
    return attention_backward(grads[0], {q_.unpack(), k_.unpack(), v_.unpack(), out_.unpack(), lse_.unpack()},
                              flags_, scale_);
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (torch::autograd::SavedVariable* saved : {&q_, &k_, &v_, &out_, &lse_}) saved->reset_data();
  }

  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    args.collect(static_cast<uint64_t>(typeid(AttentionBackward).hash_code()));
    args.collect(name());
    for (const torch::autograd::SavedVariable* saved : {&q_, &k_, &v_, &out_, &lse_}) args.collect(*saved, false);
    args.collect(flags_);
    args.collect(scale_);
  }

  // compiled autograd's call: the saved tensors (q, k, v, out, lse) and values packed after dout.
  static torch::autograd::variable_list apply_functional(const torch::autograd::variable_list& grads,
                                                         const std::vector<c10::IValue>& packed_values) {
    torch::dynamo::autograd::PackedArgs packed(packed_values);
    torch::autograd::variable_list saved(5);
    for (at::Tensor& tensor : saved) tensor = packed.unpack<at::Tensor>();
    const auto flags = packed.unpack<int64_t>();
    const auto scale = packed.unpack<double>();
    if (!grads[0].defined()) return torch::autograd::variable_list(3);
    return attention_backward(grads[0], saved, flags, scale);
  }

  torch::autograd::variable_list apply_with_saved(const torch::autograd::variable_list& inputs,
                                                  torch::dynamo::autograd::SwapSavedVariables& saved) override {
    torch::autograd::SavedVariable* members[5] = {&q_, &k_, &v_, &out_, &lse_};
    for (torch::autograd::SavedVariable* member : members) saved.before(*member);
    torch::dynamo::autograd::PackedArgs packed;
    for (torch::autograd::SavedVariable* member : members) packed.pack(member->unpack());
    packed.pack(flags_);
    packed.pack(scale_);
    const std::vector<c10::IValue> values = packed.vec();
    std::vector<at::TypePtr> schema;
    schema.reserve(values.size());
    for (const c10::IValue& value : values) schema.push_back(value.isTensor() ? at::TensorType::get() : value.type());
    const auto& compiler = torch::dynamo::autograd::getPyCompilerInterface();
    const std::string function = compiler->bind_function(saved.get_py_compiler(), name(), apply_functional, schema,
                                                         /*is_custom_function=*/true, /*is_traceable=*/false);
    const c10::IValue output_metadata =
        torch::dynamo::autograd::IValuePacker<std::vector<std::optional<torch::autograd::InputMetadata>>>::pack(
            torch::dynamo::autograd::get_input_metadata(next_edges()));
    torch::autograd::variable_list grads =
        compiler->call_function(saved.get_py_compiler(), "apply_functional", function, inputs, values, output_metadata);
    for (torch::autograd::SavedVariable* member : members) saved.after(*member);
    return grads;
  }
};

// Torch up to 2.11 holds nodes in std::shared_ptr, later torch in c10::intrusive_ptr (pytorch#181782).
template <class NodeType, class NodePtr = decltype(std::declval<const at::Tensor&>().grad_fn())>
auto new_node() {
  if constexpr (std::is_same_v<std::decay_t<NodePtr>, std::shared_ptr<torch::autograd::Node>>) {
    // deleteNode (found by argument-dependent lookup, so only where it exists) frees a long chain of
    // nodes without recursion, as torch's own nodes are freed.
    return std::shared_ptr<NodeType>(new NodeType(), [](NodeType* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<NodeType>();
  }
}

// The forward with out attached to a new AttentionBackward node; lse is the call's, saved by the node.
at::Tensor forward_with_node(Call& call, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             bool deterministic) {
  auto node = new_node<AttentionBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(q, k, v));
  at::Tensor out;
  launch_forward(call, q, /*fresh_lse=*/true, out, call.lse, /*one_block=*/true);
  torch::autograd::set_history(out, node);  // out is the node's output 0
  node->q_ = torch::autograd::SavedVariable(q, false);
  node->k_ = torch::autograd::SavedVariable(k, false);
  node->v_ = torch::autograd::SavedVariable(v, false);
  node->out_ = torch::autograd::SavedVariable(out.tensor_data(), false);
  node->lse_ = torch::autograd::SavedVariable(call.lse, false);
  node->flags_ = (call.key.causal ? kCausal : 0) | (call.key.has_scale ? kHasScale : 0) |
                 (deterministic ? kDeterministic : 0);
  node->scale_ = call.key.scale;
  return out;
}

// Whether a torch.func transform (vmap, grad, jvp, ...) is running on this thread: functorch includes
// its front-mode dispatch key while its layer stack is not empty. (Its TLS object, once created by any
// transform or by aot_function, outlives the transform, so that object's presence says nothing.)
bool functorch_transform_active() {
  return c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
}

// ---- forward(q, k, v, causal, scale, want, deterministic=False) ---------------------------------------
// want: 0 out, 1 (out, lse), 2 (out, lse, entry); 3 (out, lse) and 4 out, for tileattn.attention's eager
// call: out attached to autograd (an AttentionBackward node; deterministic picks the backward's mode) when
// grad mode is on and an input requires grad.
PyObject* forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 6 && nargs != 7) {
    PyErr_SetString(PyExc_TypeError, "forward(q, k, v, causal, scale, want, deterministic=False) takes 6 or 7 "
                    "arguments");
    return nullptr;
  }
  const long want = PyLong_AsLong(args[5]);
  if (want < 0 || want > 4) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "want must be 0, 1, 2, 3 or 4");
    return nullptr;
  }
  const int deterministic = nargs == 7 ? PyObject_IsTrue(args[6]) : 0;
  if (deterministic < 0) return nullptr;
  // Under a dispatch mode (make_fx, FakeTensorMode) the Python path runs, which takes the custom op.
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) Py_RETURN_NONE;
  Call call;
  if (!find_call(args, call)) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  const at::Tensor& q = THPVariable_Unpack(args[0]);
  const at::Tensor& k = THPVariable_Unpack(args[1]);
  const at::Tensor& v = THPVariable_Unpack(args[2]);
  at::Tensor out, lse;
  if (want >= 3) {  // tileattn.attention's eager call: the Python path raises for a tangent or a functorch transform
    if (q._fw_grad(0).defined() || k._fw_grad(0).defined() || v._fw_grad(0).defined()) Py_RETURN_NONE;
    if (functorch_transform_active()) Py_RETURN_NONE;
  }
  if (want >= 3 && at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad())) {
    out = forward_with_node(call, q, k, v, deterministic != 0);
    lse = std::move(call.lse);
  } else {
    launch_forward(call, q, /*fresh_lse=*/want != 0 && want != 4, out, lse);
  }
  if (want == 0 || want == 4) return THPVariable_Wrap(std::move(out));
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

// ---- backward(q, k, v, out, lse, dout, causal, scale, deterministic) -----------------------------------
// The op-level backward of a registered combination and dout layout, without autograd: (dq, dk, dv),
// or None for a call it leaves to the Python path (tileattn.api._backward).
PyObject* backward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 9) {
    PyErr_SetString(PyExc_TypeError, "backward(q, k, v, out, lse, dout, causal, scale, deterministic) takes 9 "
                    "arguments");
    return nullptr;
  }
  int deterministic = PyObject_IsTrue(args[8]);
  if (deterministic < 0) return nullptr;
  deterministic = deterministic || at::globalContext().deterministicAlgorithms();  // as attention_backward
  for (int i = 3; i < 6; ++i) {
    if (!THPVariable_CheckExact(args[i])) Py_RETURN_NONE;
  }
  Key key;
  BackwardCall call;
  if (!make_key(args, args[6], args[7], key) ||
      !find_backward_call(key, THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), THPVariable_Unpack(args[2]),
                          THPVariable_Unpack(args[3]), THPVariable_Unpack(args[4]), THPVariable_Unpack(args[5]),
                          deterministic != 0, call)) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  torch::autograd::variable_list grads =
      run_backward(*call.record, *call.backward, call.stream, THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]),
                   THPVariable_Unpack(args[2]), THPVariable_Unpack(args[3]), THPVariable_Unpack(args[4]),
                   THPVariable_Unpack(args[5]));
  PyObject* result = PyTuple_New(3);
  if (result == nullptr) return nullptr;
  for (int i = 0; i < 3; ++i) {
    PyObject* wrapped = THPVariable_Wrap(std::move(grads[i]));
    if (wrapped == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
    PyTuple_SET_ITEM(result, i, wrapped);
  }
  return result;
  END_HANDLE_TH_ERRORS
}

// ---- register(q, k, v, causal, scale, entry, device, launch, out_spec, lse_spec, unread_lse) -------------
PyObject* register_record(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  if (plans_namespace == nullptr || launch_kernel == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "register: configure the module first (tileattn.runtime.host_launch.load)");
    return nullptr;
  }
  PyObject *q, *k, *v, *causal, *scale, *entry, *description, *out_spec, *lse_spec, *unread_lse;
  int device;
  if (!PyArg_ParseTuple(args, "OOOOOOiOOOO:register", &q, &k, &v, &causal, &scale, &entry, &device, &description,
                        &out_spec, &lse_spec, &unread_lse)) {
    return nullptr;
  }
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
  auto record = std::make_shared<Record>();
  record->forward = parse_launch(description, kForwardSources);
  if (record->forward == nullptr || !read_spec(out_spec, record->out_sizes, record->out_strides, "out_spec") ||
      !read_spec(lse_spec, record->lse_sizes, record->lse_strides, "lse_spec")) {
    return nullptr;
  }
  if (record->out_sizes.size() != 4) {
    PyErr_SetString(PyExc_ValueError, "register: out must have rank 4");
    return nullptr;
  }
  record->device = device;
  record->unread_lse = THPVariable_Unpack(unread_lse);
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

// ---- register_backward(q, k, v, causal, scale, dout, deterministic, launches, grad_specs,
//                        workspace_elems, semaphore_elems) -> bool ----------------------------------------
// Attaches the backward of dout's layout and the mode to the record of (q, k, v, causal, scale):
// True, or False when there is no such record.
PyObject* register_backward(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *q, *k, *v, *causal, *scale, *dout, *launches, *grad_specs;
  int deterministic;
  long long workspace_elems, semaphore_elems;
  if (!PyArg_ParseTuple(args, "OOOOOOpOOLL:register_backward", &q, &k, &v, &causal, &scale, &dout, &deterministic,
                        &launches, &grad_specs, &workspace_elems, &semaphore_elems)) {
    return nullptr;
  }
  PyObject* const qkv[3] = {q, k, v};
  std::shared_ptr<Record> record = find_record(qkv, causal, scale);
  if (record == nullptr) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_FALSE;
  }
  if (!THPVariable_Check(dout) || THPVariable_Unpack(dout).dim() != 4) {
    PyErr_SetString(PyExc_TypeError, "register_backward: dout must be a tensor of rank 4");
    return nullptr;
  }
  if (workspace_elems < 0 || semaphore_elems < 0) {
    PyErr_SetString(PyExc_ValueError, "register_backward: workspace_elems and semaphore_elems must be >= 0");
    return nullptr;
  }
  auto backward = std::make_shared<BackwardRecord>();
  const at::Tensor& grad_out = THPVariable_Unpack(dout);
  for (int d = 0; d < 4; ++d) backward->dout_strides[d] = grad_out.stride(d);
  backward->dout_dtype = static_cast<int8_t>(grad_out.scalar_type());
  backward->deterministic = deterministic != 0;
  backward->workspace_elems = workspace_elems;
  backward->semaphore_elems = semaphore_elems;
  PyObject* fast = PySequence_Fast(launches, "launches");
  if (fast == nullptr) return nullptr;
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
  if (count < 1 || static_cast<size_t>(count) > kMaxBackwardLaunches) {
    Py_DECREF(fast);
    PyErr_Format(PyExc_ValueError, "register_backward: 1 to %zu launches, got %zd", kMaxBackwardLaunches, count);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    std::unique_ptr<Launch> launch = parse_launch(PySequence_Fast_GET_ITEM(fast, i), kSources);
    if (launch == nullptr) {
      Py_DECREF(fast);
      return nullptr;
    }
    for (const Slot& slot : launch->slots) {
      if (slot.kind == kTileCounter) {  // no backward kernel takes one; the capture check is the forward's
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "register_backward: a tile-counter slot in a backward launch");
        return nullptr;
      }
      if (slot.source == kWorkspace && slot.offset >= 4 * workspace_elems) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "register_backward: workspace offset %lld past its %lld bytes",
                     static_cast<long long>(slot.offset), 4 * workspace_elems);
        return nullptr;
      }
    }
    backward->launches.push_back(std::move(launch));
  }
  Py_DECREF(fast);
  fast = PySequence_Fast(grad_specs, "grad_specs");
  if (fast == nullptr) return nullptr;
  bool ok = PySequence_Fast_GET_SIZE(fast) == 3;
  for (int i = 0; ok && i < 3; ++i) {
    ok = read_spec(PySequence_Fast_GET_ITEM(fast, i), backward->grad_sizes[i], backward->grad_strides[i], "grad_specs");
  }
  Py_DECREF(fast);
  for (int i = 0; ok && i < 3; ++i) {  // every size >= 1 and stride >= 0: the storage span below is then exact
    for (size_t d = 0; d < backward->grad_sizes[i].size(); ++d) {
      ok = ok && backward->grad_sizes[i][d] >= 1 && backward->grad_strides[i][d] >= 0;
    }
  }
  if (!ok) {
    if (!PyErr_Occurred()) {
      PyErr_SetString(PyExc_ValueError, "register_backward: grad_specs must hold 3 specs with sizes >= 1 and strides "
                      ">= 0");
    }
    return nullptr;
  }
  for (int i = 0; i < 3; ++i) {
    int64_t span = 1;  // elements from the first to one past the last
    for (size_t d = 0; d < backward->grad_sizes[i].size(); ++d) {
      span += (backward->grad_sizes[i][d] - 1) * backward->grad_strides[i][d];
    }
    backward->grad_offsets[i] = backward->grad_storage_elems;
    backward->grad_storage_elems += (span + kGradAlignElems - 1) / kGradAlignElems * kGradAlignElems;
  }
  auto same = [&](const std::shared_ptr<BackwardRecord>& other) {
    return other->deterministic == backward->deterministic && other->dout_dtype == backward->dout_dtype &&
           std::memcmp(other->dout_strides, backward->dout_strides, sizeof(backward->dout_strides)) == 0;
  };
  std::vector<std::shared_ptr<BackwardRecord>>& kept = record->backward;
  for (auto it = kept.begin(); it != kept.end();) it = same(*it) ? kept.erase(it) : it + 1;
  if (kept.size() >= kMaxBackwardPerRecord) kept.erase(kept.begin());
  kept.push_back(std::move(backward));
  Py_RETURN_TRUE;
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

PyObject* backward_record_count(PyObject*, PyObject*) {
  size_t count = 0;
  for (const auto& item : records) count += item.second->backward.size();
  return PyLong_FromSize_t(count);
}

PyMethodDef methods[] = {
    {"forward", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(forward)), METH_FASTCALL,
     "forward(q, k, v, causal, scale, want, deterministic=False): out (want 0), (out, lse) (1), (out, lse, entry) "
     "(2), (out, lse) (3) or out (4), 3 and 4 with autograd when an input requires grad, for a registered "
     "combination, launched on torch's current stream; None when the call is not one"},
    {"backward", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(backward)), METH_FASTCALL,
     "backward(q, k, v, out, lse, dout, causal, scale, deterministic): (dq, dk, dv) for a registered combination "
     "and dout layout, launched on torch's current stream; None when the call is not one"},
    {"register", register_record, METH_VARARGS,
     "register(q, k, v, causal, scale, entry, device, launch, out_spec, lse_spec, unread_lse): a planned "
     "combination; launch = (function, grid, block, smem, buffer, param_offsets, slots)"},
    {"register_backward", register_backward, METH_VARARGS,
     "register_backward(q, k, v, causal, scale, dout, deterministic, launches, grad_specs, workspace_elems, "
     "semaphore_elems): the backward of a registered combination for dout's layout; False when none is registered"},
    {"configure", configure, METH_VARARGS,
     "set the driver entry points, stream_counters, LaunchError and tileattn.api's namespace"},
    {"clear", clear, METH_NOARGS, "drop every record"},
    {"set_poison", set_poison, METH_O, "tests: fill every output and workspace with NaN before its launch (True) or not"},
    {"record_count", record_count, METH_NOARGS, "how many combinations are registered"},
    {"backward_record_count", backward_record_count, METH_NOARGS, "how many backward records the combinations hold"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_host_launch", "tileattn's compiled attention path", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__host_launch(void) { return PyModule_Create(&module); }
