// stub: Metal Performance Primitives' tensor ops (mpp::tensor_ops::matmul2d), modelled in msl_tensor.h
#include "../msl_shim.h"
#include "../msl_tensor.h"
