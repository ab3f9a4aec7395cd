/* dedupe_worker._resp: one Redis command packed as RESP bytes, the compiled twin of
 * hiredis.pack_command.
 *
 * What is guaranteed: pack_command(args) returns byte for byte what hiredis.pack_command(args)
 * returns (hiredis-py 3.x), and raises the exception type hiredis raises, at the same argument:
 *
 *   args    a tuple (or a tuple subclass); anything else, a list too: TypeError
 *   str     UTF-8 (a str subclass too); a lone surrogate: UnicodeEncodeError
 *   bytes   as is (a bytes subclass too)
 *   memoryview  its bytes, as is
 *   int     decimal, any size (int itself only: bool, IntEnum and other subclasses: TypeError)
 *   float   repr() (a float subclass too: its own __repr__), e.g. 0.5, -0.0, inf, nan, 1e+100
 *   other   (bytearray, None, ...): TypeError
 *
 * Where hiredis reads memory it does not own or dereferences NULL, this raises instead: an int
 * too long for str() (ValueError, sys.set_int_max_str_digits), a memoryview that is released
 * (ValueError) or not C-contiguous (BufferError), a float subclass whose __repr__ fails.
 *
 * Why: hiredis copies every argument into an sds string and formats every length with
 * sprintf; the protocol's script calls carry up to a few hundred arguments each, so a batch's
 * client CPU goes largely to packing (docs/performance.md, bench.held_connection's batch case). Here every length is written by a small integer-to-decimal routine,
 * the total size is computed first and the bytes object allocated once, each argument copied
 * into it once. The protocol's arguments are str, bytes and small ints: none of them needs a
 * temporary object. Large ints and floats go through repr(), as in hiredis.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* One argument between the two passes: its bytes (data, len), or an integer (value) whose
 * decimal form, len characters long, is written in the second pass. A repr() or a memoryview's
 * copy is kept alive in owned until the bytes object is built. */
typedef struct {
    const char *data;  /* NULL: the argument is the integer in value */
    Py_ssize_t len;
    long long value;
    PyObject *owned;
} Piece;

/* Arguments of a command up to this many are described on the stack (a 32-key claim has ~165). */
#define STACK_PIECES 256

static const char DIGIT_PAIRS[201] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

/* How many decimal digits n has (at least 1). */
static inline int
count_digits(unsigned long long n)
{
    int digits = 1;
    for (;;) {
        if (n < 10) return digits;
        if (n < 100) return digits + 1;
        if (n < 1000) return digits + 2;
        if (n < 10000) return digits + 3;
        n /= 10000;
        digits += 4;
    }
}

/* Writes n's count_digits(n) digits ending just before end; returns the start. */
static inline char *
write_digits(char *end, unsigned long long n)
{
    while (n >= 100) {
        unsigned int pair = (unsigned int)(n % 100) * 2;
        n /= 100;
        *--end = DIGIT_PAIRS[pair + 1];
        *--end = DIGIT_PAIRS[pair];
    }
    if (n >= 10) {
        unsigned int pair = (unsigned int)n * 2;
        *--end = DIGIT_PAIRS[pair + 1];
        *--end = DIGIT_PAIRS[pair];
    }
    else {
        *--end = (char)('0' + n);
    }
    return end;
}

/* Writes "<prefix><n>\r\n" at out (prefix '*' or '$'); returns the position after it. */
static inline char *
write_header(char *out, char prefix, Py_ssize_t n)
{
    int digits = count_digits((unsigned long long)n);
    *out++ = prefix;
    write_digits(out + digits, (unsigned long long)n);
    out += digits;
    *out++ = '\r';
    *out++ = '\n';
    return out;
}

/* The magnitude of v, without overflow at LLONG_MIN. */
static inline unsigned long long
magnitude(long long v)
{
    return v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
}

/* Size of "$<len>\r\n<data>\r\n". */
static inline Py_ssize_t
bulk_size(Py_ssize_t len)
{
    return 1 + count_digits((unsigned long long)len) + 2 + len + 2;
}

/* Sets piece to item's bytes (a str result of repr() or a bytes copy), keeping item alive. */
static int
own(Piece *piece, PyObject *item)
{
    if (item == NULL)
        return -1;
    piece->owned = item;
    if (PyBytes_Check(item)) {
        piece->data = PyBytes_AS_STRING(item);
        piece->len = PyBytes_GET_SIZE(item);
        return 0;
    }
    piece->data = PyUnicode_AsUTF8AndSize(item, &piece->len);
    return piece->data == NULL ? -1 : 0;
}

/* Describes item in piece, or sets an exception and returns -1. */
static int
describe(Piece *piece, PyObject *item)
{
    if (PyBytes_Check(item)) {
        piece->data = PyBytes_AS_STRING(item);
        piece->len = PyBytes_GET_SIZE(item);
        return 0;
    }
    if (PyUnicode_Check(item)) {
        piece->data = PyUnicode_AsUTF8AndSize(item, &piece->len);  /* cached in the str */
        return piece->data == NULL ? -1 : 0;
    }
    if (PyMemoryView_Check(item)) {
        /* A copy: the view could be released before the second pass (by a float's __repr__). */
        Py_buffer view;
        if (PyObject_GetBuffer(item, &view, PyBUF_SIMPLE) < 0)  /* released, not contiguous */
            return -1;
        PyObject *copy = PyBytes_FromStringAndSize(view.buf, view.len);
        PyBuffer_Release(&view);
        return own(piece, copy);
    }
    if (PyLong_CheckExact(item)) {
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow)  /* beyond 64 bits: repr(), which refuses past int_max_str_digits */
            return own(piece, PyObject_Repr(item));
        if (value == -1 && PyErr_Occurred())
            return -1;
        piece->data = NULL;
        piece->value = value;
        piece->len = count_digits(magnitude(value)) + (value < 0);
        return 0;
    }
    if (PyFloat_Check(item))
        return own(piece, PyObject_Repr(item));
    PyErr_SetString(PyExc_TypeError, "A tuple item must be str, int, float or bytes.");
    return -1;
}

static PyObject *
pack_command(PyObject *module, PyObject *args)
{
    (void)module;
    if (!PyTuple_Check(args)) {
        PyErr_SetString(PyExc_TypeError, "The argument must be a tuple of str, int, float or bytes.");
        return NULL;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(args);
    Piece stack[STACK_PIECES];
    Piece *pieces = stack;
    if (count > STACK_PIECES) {
        pieces = PyMem_New(Piece, count);
        if (pieces == NULL)
            return PyErr_NoMemory();
    }
    PyObject *result = NULL;
    Py_ssize_t described = 0;

    /* First pass: every argument's bytes and the total size. */
    Py_ssize_t total = 1 + count_digits((unsigned long long)count) + 2;  /* "*<count>\r\n" */
    for (; described < count; described++) {
        Piece *piece = &pieces[described];
        piece->owned = NULL;
        if (describe(piece, PyTuple_GET_ITEM(args, described)) < 0) {
            described++;  /* its owned object, if any, is released below */
            goto done;
        }
        if (piece->len > PY_SSIZE_T_MAX / 2 - total - 64) {
            PyErr_NoMemory();
            described++;
            goto done;
        }
        total += bulk_size(piece->len);
    }

    /* Second pass: write them into the one bytes object. */
    result = PyBytes_FromStringAndSize(NULL, total);
    if (result == NULL)
        goto done;
    char *out = write_header(PyBytes_AS_STRING(result), '*', count);
    for (Py_ssize_t i = 0; i < count; i++) {
        const Piece *piece = &pieces[i];
        out = write_header(out, '$', piece->len);
        if (piece->data != NULL) {
            memcpy(out, piece->data, (size_t)piece->len);
            out += piece->len;
        }
        else {  /* an integer: its digits end right before the "\r\n" */
            out += piece->len;
            char *start = write_digits(out, magnitude(piece->value));
            if (piece->value < 0)
                start[-1] = '-';
        }
        *out++ = '\r';
        *out++ = '\n';
    }
    assert(out == PyBytes_AS_STRING(result) + total);

done:
    for (Py_ssize_t i = 0; i < described; i++)
        Py_XDECREF(pieces[i].owned);
    if (pieces != stack)
        PyMem_Free(pieces);
    return result;
}

PyDoc_STRVAR(pack_command_doc,
"pack_command(args, /)\n--\n\n"
"The RESP bytes of one command: byte for byte what hiredis.pack_command(args) returns, the\n"
"same exception types where it refuses an argument (see the module's documentation).");

static PyMethodDef methods[] = {
    {"pack_command", pack_command, METH_O, pack_command_doc},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_mod_gil
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

PyDoc_STRVAR(module_doc,
"Redis commands packed as RESP bytes, exactly as hiredis.pack_command packs them, faster.\n\n"
"Chosen by dedupe_worker._transport.held.direct_packer where it packs as the connection does;\n"
"DEDUPE_PURE_PYTHON=1 makes the library ignore it.");

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dedupe_worker._resp",
    .m_doc = module_doc,
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC
PyInit__resp(void)
{
    return PyModuleDef_Init(&module_def);
}
