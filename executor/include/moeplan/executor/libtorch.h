#pragma once
// The parts of LibTorch's C++ API the executor uses: tensors and their operations (ATen),
// autograd and its modes, seeding, and CUDA's device count. Not <torch/torch.h>, which adds the
// module, optimizer, data, serialization and JIT APIs: with GCC every file that includes LibTorch
// instantiates the templates its headers leave pending, even from the precompiled header
// (executor/CMakeLists.txt): about 6 s a file for <torch/torch.h> against 3 s for these
// (docs/decisions.md, "Narrow LibTorch headers").
#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/types.h>
#include <torch/utils.h>
