// The Python module gearsam_fused._C: what is not an operator. Importing it also registers the kernels as operators,
// torch.ops.gearsam_fused.<name> (library.cpp), as they are in the same shared library.

#include <torch/extension.h>

#include "cpu/stream.h"
#include "gearsam.h"
#include "host_checks.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "Fused GEAR-SAM / SAM step kernels (CPU, and CUDA when built with it) over flat parameter buckets, registered "
      "as the operators torch.ops.gearsam_fused.<name> on import.";
  m.def("cpu_stream_threshold_bytes", &gearsam::cpu::stream_threshold_bytes,
        "The CPU kernels write outputs they do not read (backup, restored or updated parameter) with non-temporal "
        "stores where the output is larger than this many bytes (a core's private cache); -1 where they never do.");
  m.def("built_with_cuda", &gearsam::built_with_cuda, "Whether this build contains the CUDA kernels.");
  gearsam::host::bind(m);
}
