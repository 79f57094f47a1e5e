/* Exception-safe calls into SEAL's C++ functions for polyfhe/engines/seal/native.py (opened with ctypes).
 *
 * native.py calls seven SEAL functions exported by TenSEAL's _sealapi_cpp (ciphertext copy,
 * multiply_plain_ntt, add_inplace, rotate_internal, multiply_inplace, relinearize_internal, rescale_to_next)
 * through ctypes, with the GIL released. A C++ exception must
 * never unwind into ctypes' C frames: it would reach std::terminate and abort the whole process (a server, with
 * every client's session). Each wrapper here takes the SEAL function's address (looked up in TenSEAL's library
 * by its mangled name) and its arguments, calls it inside try/catch and returns a status instead:
 *
 *   0  done
 *   1  a std::exception (SEAL's invalid_argument, logic_error, ...): its what() is copied into `message`
 *   2  an exception of another type (`message`: a fixed text)
 *   3  std::bad_alloc (the caller raises MemoryError, as the bindings do)
 *
 * No SEAL headers are needed: under the Itanium C++ ABI a member function is a free function taking `this`
 * first, references are pointers, and a non-trivially-copyable argument passed by value (the
 * MemoryPoolHandle of rotate_internal, multiply_inplace, relinearize_internal and rescale_to_next) is a
 * caller-owned temporary passed by address. Every object is therefore a void*.
 *
 * The catch of std::exception matches SEAL's throws because this library and SEAL share one libstdc++ (both
 * link it dynamically: the install builds this file with g++, -fexceptions, and -lstdc++); native.py's
 * self-test checks that a refusal comes back as status 1 with SEAL's message before it enables the native path.
 *
 * Like _kernels.c this is an extension module only so that setuptools builds it and Python can locate it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstddef>
#include <cstring>
#include <exception>
#include <new>

#define POLYFHE_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using AssignFn = void *(*)(void *, const void *);                          // Ciphertext::operator=
using MultiplyPlainNttFn = void (*)(const void *, void *, const void *);   // Evaluator::multiply_plain_ntt
using AddInplaceFn = void (*)(const void *, void *, const void *);         // Evaluator::add_inplace
using RotateInternalFn = void (*)(const void *, void *, int, const void *, void *);  // Evaluator::rotate_internal
using MultiplyInplaceFn = void (*)(const void *, void *, const void *, void *);       // Evaluator::multiply_inplace
using RelinearizeInternalFn = void (*)(const void *, void *, const void *, size_t, void *);  // relinearize_internal
using RescaleToNextFn = void (*)(const void *, const void *, void *, void *);        // Evaluator::rescale_to_next

void copy_message(const char *text, char *message, size_t size) {
    if (message == nullptr || size == 0) {
        return;
    }
    if (text == nullptr) {
        text = "";
    }
    size_t length = std::strlen(text);
    if (length >= size) {
        length = size - 1;
    }
    std::memcpy(message, text, length);
    message[length] = '\0';
}

template <class Call>
int guarded(Call &&call, char *message, size_t size) noexcept {
    try {
        call();
        copy_message("", message, size);
        return 0;
    } catch (const std::bad_alloc &e) {
        copy_message(e.what(), message, size);
        return 3;
    } catch (const std::exception &e) {
        copy_message(e.what(), message, size);
        return 1;
    } catch (...) {
        copy_message("an exception that is not a std::exception", message, size);
        return 2;
    }
}

}  // namespace

POLYFHE_EXPORT int polyfhe_seal_assign(void *fn, void *destination, const void *source, char *message,
                                       size_t size) {
    return guarded([&] { reinterpret_cast<AssignFn>(fn)(destination, source); }, message, size);
}

POLYFHE_EXPORT int polyfhe_seal_multiply_plain_ntt(void *fn, const void *evaluator, void *encrypted,
                                                   const void *plain, char *message, size_t size) {
    return guarded([&] { reinterpret_cast<MultiplyPlainNttFn>(fn)(evaluator, encrypted, plain); }, message, size);
}

POLYFHE_EXPORT int polyfhe_seal_add_inplace(void *fn, const void *evaluator, void *encrypted1,
                                            const void *encrypted2, char *message, size_t size) {
    return guarded([&] { reinterpret_cast<AddInplaceFn>(fn)(evaluator, encrypted1, encrypted2); }, message, size);
}

POLYFHE_EXPORT int polyfhe_seal_rotate_internal(void *fn, const void *evaluator, void *encrypted, int steps,
                                                const void *galois_keys, void *pool, char *message, size_t size) {
    return guarded([&] { reinterpret_cast<RotateInternalFn>(fn)(evaluator, encrypted, steps, galois_keys, pool); },
                   message, size);
}

POLYFHE_EXPORT int polyfhe_seal_multiply_inplace(void *fn, const void *evaluator, void *encrypted1,
                                                 const void *encrypted2, void *pool, char *message, size_t size) {
    return guarded([&] { reinterpret_cast<MultiplyInplaceFn>(fn)(evaluator, encrypted1, encrypted2, pool); },
                   message, size);
}

POLYFHE_EXPORT int polyfhe_seal_relinearize_internal(void *fn, const void *evaluator, void *encrypted,
                                                     const void *relin_keys, size_t destination_size, void *pool,
                                                     char *message, size_t size) {
    return guarded(
        [&] { reinterpret_cast<RelinearizeInternalFn>(fn)(evaluator, encrypted, relin_keys, destination_size, pool); },
        message, size);
}

POLYFHE_EXPORT int polyfhe_seal_rescale_to_next(void *fn, const void *evaluator, const void *encrypted,
                                                void *destination, void *pool, char *message, size_t size) {
    return guarded([&] { reinterpret_cast<RescaleToNextFn>(fn)(evaluator, encrypted, destination, pool); },
                   message, size);
}

static struct PyModuleDef shim_module = {
    PyModuleDef_HEAD_INIT, "_seal_shim", "Exception-safe SEAL calls, opened with ctypes by polyfhe.engines.seal.native.",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__seal_shim(void) { return PyModule_Create(&shim_module); }
