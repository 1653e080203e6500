// The host side of index faults (index_faults.hpp): one record per CUDA device, and the checks
// that turn a recorded fault into an Error.
#pragma once

#include <string>

#include "index_faults.hpp"

namespace flashattn::cuda {

// Device `device`'s sink, made on first use (a word of device memory, a record of mapped host
// memory; kept for the process's life). Call with the device current.
IndexFaultSink index_fault_sink(int device);

// What raise_index_fault says of `fault`, found on cuda:`device`.
std::string index_fault_message(const IndexFault& fault, int device);

// Throws a fault recorded on `device` as Error(kInvalidArgument) naming the argument and the
// entry, and clears the record (its claim reset on `stream`, so the next fault is kept);
// returns when none is recorded. Reads host memory only: it never waits for the device.
void raise_index_fault(int device, void* stream);

// Waits for device `device` (every device with a record when -1), then raise_index_fault.
void check_device_errors(int device);

}  // namespace flashattn::cuda
