/* The kernels as a CPython extension module (pagedserve_cpu), compiled into the same library where
 * Python's headers are found (kernels/native.py defines PS_PYTHON_ENTRY then): METH_FASTCALL
 * functions of the kernels' own names and arguments, which kernels/native.py calls in place of the
 * ctypes ones. ctypes converts every argument through its argtypes, at many times the cost of a
 * call through these, and a decode step makes about nine kernel calls a layer, so a visible share
 * of a batch-1 step went to converting arguments (bench/native_calls.py measures it).
 *
 * Each function's argument letters (SIGNATURES, which kernels/native.py checks against its ctypes
 * declarations) say how each Python argument converts: p a pointer (an int, or None for NULL),
 * i an integer, f a float. The GIL is released around the kernel, as ctypes does. */
#ifdef PS_PYTHON_ENTRY
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "api.h"

/* A union member of the wrong kind for a pointer or integer parameter is then a compile error. */
#pragma GCC diagnostic error "-Wint-conversion"

#define PS_MAX_ARGS 20

typedef union {
    void *p;
    int64_t i;
    double f;
} ps_arg;

/* args -> v by the letters of fmt; 0, or -1 with a TypeError naming the kernel and argument. */
static int convert(const char *name, const char *fmt, PyObject *const *args, Py_ssize_t nargs, ps_arg *v) {
    Py_ssize_t n = (Py_ssize_t)strlen(fmt);
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, n, nargs);
        return -1;
    }
    for (Py_ssize_t a = 0; a < n; a++) {
        PyObject *o = args[a];
        if (fmt[a] == 'f') {
            v[a].f = PyFloat_AsDouble(o);
        } else if (fmt[a] == 'p' && o == Py_None) {
            v[a].p = NULL;
        } else if (!PyLong_Check(o)) {
            PyErr_Format(PyExc_TypeError, "%s argument %zd must be an int%s, got %s", name, a,
                         fmt[a] == 'p' ? " or None" : "", Py_TYPE(o)->tp_name);
            return -1;
        } else if (fmt[a] == 'p') {
            v[a].p = PyLong_AsVoidPtr(o);
        } else {
            v[a].i = PyLong_AsLongLong(o);
        }
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

/* One entry: `call` is the kernel called on v[0..], each argument as the union member its letter
 * in fmt names (.p, .i or .f). */
#define PS_ENTRY(kernel, fmt, call)                                                         \
    static PyObject *entry_##kernel(PyObject *self, PyObject *const *args, Py_ssize_t nargs) { \
        (void)self;                                                                         \
        _Static_assert(sizeof(fmt) - 1 <= PS_MAX_ARGS, #kernel ": more than PS_MAX_ARGS");  \
        ps_arg v[PS_MAX_ARGS];                                                              \
        if (convert(#kernel, fmt, args, nargs, v)) return NULL;                             \
        int status;                                                                         \
        Py_BEGIN_ALLOW_THREADS                                                              \
        status = call;                                                                      \
        Py_END_ALLOW_THREADS                                                                \
        return PyLong_FromLong(status);                                                     \
    }
#define PS_PANEL_ENTRY(kernel)                                                              \
    static PyObject *entry_##kernel(PyObject *self, PyObject *const *args, Py_ssize_t nargs) { \
        (void)self, (void)args;                                                             \
        if (nargs) {                                                                        \
            PyErr_Format(PyExc_TypeError, "%s takes no arguments", #kernel);                \
            return NULL;                                                                    \
        }                                                                                   \
        return PyLong_FromLong(kernel());                                                   \
    }

#define FMT_ATTENTION "ppipiipippiiiiififii"
PS_ENTRY(pagedserve_paged_decode_attention, FMT_ATTENTION,
         pagedserve_paged_decode_attention(v[0].p, v[1].p, v[2].i, v[3].p, v[4].i, v[5].i, v[6].p,
                                           v[7].i, v[8].p, v[9].p, v[10].i, v[11].i, v[12].i,
                                           v[13].i, v[14].i, (float)v[15].f, v[16].i, (float)v[17].f,
                                           (int)v[18].i, (int)v[19].i))
PS_ENTRY(pagedserve_paged_prefill_attention, FMT_ATTENTION,
         pagedserve_paged_prefill_attention(v[0].p, v[1].p, v[2].i, v[3].p, v[4].i, v[5].i, v[6].p,
                                            v[7].i, v[8].p, v[9].p, v[10].i, v[11].i, v[12].i,
                                            v[13].i, v[14].i, (float)v[15].f, v[16].i,
                                            (float)v[17].f, (int)v[18].i, (int)v[19].i))
#define FMT_ARGMAX_ROWS "ppiiiii"
PS_ENTRY(pagedserve_argmax_rows, FMT_ARGMAX_ROWS,
         pagedserve_argmax_rows(v[0].p, v[1].p, v[2].i, v[3].i, v[4].i, (int)v[5].i, (int)v[6].i))
#define FMT_SAMPLE_ROWS "ppppiiiii"
PS_ENTRY(pagedserve_sample_rows, FMT_SAMPLE_ROWS,
         pagedserve_sample_rows(v[0].p, v[1].p, v[2].p, v[3].p, v[4].i, v[5].i, v[6].i, (int)v[7].i,
                                (int)v[8].i))
#define FMT_RMS_NORM "pppiifii"
PS_ENTRY(pagedserve_rms_norm, FMT_RMS_NORM,
         pagedserve_rms_norm(v[0].p, v[1].p, v[2].p, v[3].i, v[4].i, (float)v[5].f, (int)v[6].i,
                             (int)v[7].i))
PS_ENTRY(pagedserve_fused_add_rms_norm, FMT_RMS_NORM,
         pagedserve_fused_add_rms_norm(v[0].p, v[1].p, v[2].p, v[3].i, v[4].i, (float)v[5].f,
                                       (int)v[6].i, (int)v[7].i))
#define FMT_SILU_AND_MUL "ppiiii"
PS_ENTRY(pagedserve_silu_and_mul, FMT_SILU_AND_MUL,
         pagedserve_silu_and_mul(v[0].p, v[1].p, v[2].i, v[3].i, (int)v[4].i, (int)v[5].i))
#define FMT_ROTARY_STORE_KV "pippippiiiiiiii"
PS_ENTRY(pagedserve_rotary_store_kv, FMT_ROTARY_STORE_KV,
         pagedserve_rotary_store_kv(v[0].p, v[1].i, v[2].p, v[3].p, v[4].i, v[5].p, v[6].p, v[7].i,
                                    v[8].i, v[9].i, v[10].i, v[11].i, v[12].i, (int)v[13].i,
                                    (int)v[14].i))
#define FMT_LINEAR "ppippiiii"
PS_ENTRY(pagedserve_linear, FMT_LINEAR,
         pagedserve_linear(v[0].p, v[1].p, v[2].i, v[3].p, v[4].p, v[5].i, v[6].i, v[7].i,
                           (int)v[8].i))
PS_ENTRY(pagedserve_grouped_linear, FMT_LINEAR,
         pagedserve_grouped_linear(v[0].p, v[1].p, v[2].i, v[3].p, v[4].p, v[5].i, v[6].i, v[7].i,
                                   (int)v[8].i))
#define FMT_LINEAR_BF16 "ppippiiiii"
PS_ENTRY(pagedserve_linear_bf16, FMT_LINEAR_BF16,
         pagedserve_linear_bf16(v[0].p, v[1].p, v[2].i, v[3].p, v[4].p, (int)v[5].i, v[6].i, v[7].i,
                                v[8].i, (int)v[9].i))
#define FMT_QUANT_LINEAR "ppippppiiiiiii"
PS_ENTRY(pagedserve_quant_linear, FMT_QUANT_LINEAR,
         pagedserve_quant_linear(v[0].p, v[1].p, v[2].i, v[3].p, v[4].p, v[5].p, v[6].p, (int)v[7].i,
                                 (int)v[8].i, v[9].i, v[10].i, v[11].i, v[12].i, (int)v[13].i))
#define FMT_QUANT_LINEAR_I8 "ppippipiiiiii"
PS_ENTRY(pagedserve_quant_linear_i8, FMT_QUANT_LINEAR_I8,
         pagedserve_quant_linear_i8(v[0].p, v[1].p, v[2].i, v[3].p, v[4].p, (int)v[5].i, v[6].p,
                                    (int)v[7].i, v[8].i, v[9].i, v[10].i, v[11].i, (int)v[12].i))
#define FMT_DECODER_LAYERS "pppppppppppppffi"
PS_ENTRY(pagedserve_decoder_layers, FMT_DECODER_LAYERS,
         pagedserve_decoder_layers(v[0].p, v[1].p, v[2].p, v[3].p, v[4].p, v[5].p, v[6].p, v[7].p,
                                   v[8].p, v[9].p, v[10].p, v[11].p, v[12].p, (float)v[13].f,
                                   (float)v[14].f, (int)v[15].i))
#define FMT_LORA_DELTA "pipippppiiiiiii"
PS_ENTRY(pagedserve_lora_delta, FMT_LORA_DELTA,
         pagedserve_lora_delta(v[0].p, v[1].i, v[2].p, v[3].i, v[4].p, v[5].p, v[6].p, v[7].p,
                               v[8].i, v[9].i, v[10].i, v[11].i, v[12].i, (int)v[13].i,
                               (int)v[14].i))
PS_PANEL_ENTRY(pagedserve_linear_panel)
PS_PANEL_ENTRY(pagedserve_linear_bf16_panel)
PS_PANEL_ENTRY(pagedserve_quant_linear_panel)
PS_PANEL_ENTRY(pagedserve_quant_linear_i8_panel)

#define PS_METHOD(kernel) {#kernel, (PyCFunction)(void (*)(void))entry_##kernel, METH_FASTCALL, NULL},
static PyMethodDef methods[] = {
    PS_METHOD(pagedserve_paged_decode_attention) PS_METHOD(pagedserve_paged_prefill_attention)
    PS_METHOD(pagedserve_argmax_rows) PS_METHOD(pagedserve_sample_rows) PS_METHOD(pagedserve_rms_norm)
    PS_METHOD(pagedserve_fused_add_rms_norm) PS_METHOD(pagedserve_silu_and_mul)
    PS_METHOD(pagedserve_rotary_store_kv) PS_METHOD(pagedserve_linear)
    PS_METHOD(pagedserve_grouped_linear) PS_METHOD(pagedserve_linear_bf16)
    PS_METHOD(pagedserve_quant_linear) PS_METHOD(pagedserve_quant_linear_i8)
    PS_METHOD(pagedserve_linear_panel) PS_METHOD(pagedserve_linear_bf16_panel)
    PS_METHOD(pagedserve_quant_linear_panel) PS_METHOD(pagedserve_quant_linear_i8_panel)
    PS_METHOD(pagedserve_decoder_layers) PS_METHOD(pagedserve_lora_delta)
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pagedserve_cpu", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_pagedserve_cpu(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *signatures = Py_BuildValue(
        "{ssssssssssssssssssssssssssssssssssssss}",
        "pagedserve_paged_decode_attention", FMT_ATTENTION,
        "pagedserve_paged_prefill_attention", FMT_ATTENTION,
        "pagedserve_argmax_rows", FMT_ARGMAX_ROWS, "pagedserve_sample_rows", FMT_SAMPLE_ROWS,
        "pagedserve_rms_norm", FMT_RMS_NORM,
        "pagedserve_fused_add_rms_norm", FMT_RMS_NORM, "pagedserve_silu_and_mul", FMT_SILU_AND_MUL,
        "pagedserve_rotary_store_kv", FMT_ROTARY_STORE_KV, "pagedserve_linear", FMT_LINEAR,
        "pagedserve_grouped_linear", FMT_LINEAR, "pagedserve_linear_bf16", FMT_LINEAR_BF16,
        "pagedserve_quant_linear", FMT_QUANT_LINEAR, "pagedserve_quant_linear_i8", FMT_QUANT_LINEAR_I8,
        "pagedserve_linear_panel", "", "pagedserve_linear_bf16_panel", "",
        "pagedserve_quant_linear_panel", "", "pagedserve_quant_linear_i8_panel", "",
        "pagedserve_decoder_layers", FMT_DECODER_LAYERS, "pagedserve_lora_delta", FMT_LORA_DELTA);
    if (!signatures || PyModule_AddObject(m, "SIGNATURES", signatures)) {
        Py_XDECREF(signatures);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

#endif
