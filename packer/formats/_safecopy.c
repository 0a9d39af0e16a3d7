/* packer.formats._safecopy: memcpy out of a memory-mapped file that survives the file being truncated meanwhile.
 *
 * A page of a shared file map past the file's new end faults with SIGBUS, which kills the process whatever
 * thread touched it. copy() runs its memcpy calls under a SIGBUS handler that jumps back out of the copy
 * (sigsetjmp/siglongjmp, per thread) and reports the failure instead: the caller turns it into a PackerError
 * (packer/formats/safecopy.py). A SIGBUS anywhere else goes to the handler that was there before (or kills the process,
 * as without this module). Python's wrapper re-installs the handler where another one replaced it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <signal.h>
#include <string.h>

static __thread sigjmp_buf *volatile guard; /* set while this thread copies (volatile: the copies never read it) */
static struct sigaction previous;   /* the SIGBUS disposition before ours */

static __thread volatile int forwarding; /* this thread is in the previous handler (which may hand back to us) */

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    sigjmp_buf *jump = guard;
    if (jump != NULL) {
        guard = NULL;
        siglongjmp(*jump, 1);
    }
    /* not a guarded copy: what would have happened without us, once (a previous handler, e.g. faulthandler's,
     * that raises the signal again after restoring its own previous one, which may be ours, ends in the default) */
    if (!forwarding) {
        if ((previous.sa_flags & SA_SIGINFO) && previous.sa_sigaction != NULL) {
            forwarding = 1;
            previous.sa_sigaction(sig, info, context);
            forwarding = 0;
            return;
        }
        if (!(previous.sa_flags & SA_SIGINFO) && previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN
                && previous.sa_handler != NULL) {
            forwarding = 1;
            previous.sa_handler(sig);
            forwarding = 0;
            return;
        }
    }
    signal(SIGBUS, SIG_DFL); /* the faulting access runs again on return and kills the process */
}

static int installed(void)
{
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0)
        return 0;
    return (now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus;
}

static PyObject *install(PyObject *self, PyObject *unused)
{
    if (!installed()) {
        struct sigaction ours;
        memset(&ours, 0, sizeof ours);
        ours.sa_sigaction = on_sigbus;
        ours.sa_flags = SA_SIGINFO | SA_NODEFER;
        sigemptyset(&ours.sa_mask);
        if (sigaction(SIGBUS, &ours, &previous) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *is_installed(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(installed());
}

/* copy(dsts, srcs) -> index of the first pair whose copy faulted, or -1: each writable dsts[k] gets srcs[k]'s
 * bytes (of the same length), with the GIL released. */
static PyObject *copy(PyObject *self, PyObject *args)
{
    PyObject *dsts, *srcs;
    if (!PyArg_ParseTuple(args, "OO:copy", &dsts, &srcs))
        return NULL;
    PyObject *dseq = PySequence_Fast(dsts, "dsts must be a sequence");
    if (dseq == NULL)
        return NULL;
    PyObject *sseq = PySequence_Fast(srcs, "srcs must be a sequence");
    if (sseq == NULL) {
        Py_DECREF(dseq);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(dseq);
    Py_buffer *views = NULL;
    Py_ssize_t held = 0, failed = -1;
    if (PySequence_Fast_GET_SIZE(sseq) != n) {
        PyErr_SetString(PyExc_ValueError, "dsts and srcs differ in length");
        goto done;
    }
    views = PyMem_Calloc(2 * (size_t)(n ? n : 1), sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(dseq, k), &views[2 * k], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS))
            goto done;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(sseq, k), &views[2 * k + 1], PyBUF_C_CONTIGUOUS)) {
            PyBuffer_Release(&views[2 * k]);
            goto done;
        }
        held = k + 1;
        if (views[2 * k].len != views[2 * k + 1].len) {
            PyErr_SetString(PyExc_ValueError, "a destination and its source differ in length");
            goto done;
        }
    }
    {
        volatile Py_ssize_t k = 0;
        Py_BEGIN_ALLOW_THREADS
        sigjmp_buf jump;
        if (sigsetjmp(jump, 1) == 0) {
            guard = &jump;
            for (; k < n; k++)
                memcpy(views[2 * k].buf, views[2 * k + 1].buf, (size_t)views[2 * k].len);
            guard = NULL;
        } else {
            failed = k; /* the handler cleared the guard */
        }
        Py_END_ALLOW_THREADS
    }
done:
    for (Py_ssize_t k = 0; k < held; k++) {
        PyBuffer_Release(&views[2 * k]);
        PyBuffer_Release(&views[2 * k + 1]);
    }
    PyMem_Free(views);
    Py_DECREF(dseq);
    Py_DECREF(sseq);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(failed);
}

static PyMethodDef methods[] = {
    {"install", install, METH_NOARGS, "Install the SIGBUS handler (again, where another replaced it)."},
    {"is_installed", is_installed, METH_NOARGS, "Whether the SIGBUS handler is the one in place."},
    {"copy", copy, METH_VARARGS, "copy(dsts, srcs) -> the first index whose source faulted (SIGBUS), or -1."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_safecopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__safecopy(void)
{
    return PyModule_Create(&module);
}
