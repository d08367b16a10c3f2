/* tb_lua.c — TensorBoard event records for ds4.core.tb (lua/ds4/tensorboard.lua writes them to a file).
 *
 *   tb.file_version(wall_time)                    -> the record that opens an event file ("brain.Event:2")
 *   tb.scalars(wall_time, step, {tag = number})   -> one Event with a Summary of simple_value entries (tags sorted)
 *   tb.text(wall_time, step, tag, text | rows)    -> one Event with a text-plugin string tensor: a string (0-d), or
 *                                                    an array of equal-length arrays of strings (a [R, C] tensor,
 *                                                    which TensorBoard's Text tab shows as a table)
 *   tb.crc32c(s)                                  -> CRC-32C (Castagnoli) of s, as TFRecord framing uses it
 *
 * The Event protobuf is encoded by protobuf-c from lua/tb_event.proto (TensorBoard's field numbers). A record is
 * TFRecord framing around it: uint64 length (little-endian), uint32 masked CRC-32C of those 8 bytes, the bytes,
 * uint32 masked CRC-32C of the bytes; mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8. Everything a message points
 * to lives in Lua values on the stack (strings, scratch userdata), so an error raised midway leaks nothing. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ds4lua.h"
#include "tb_event.pb-c.h"

#define DT_STRING 7

/* CRC-32C, reflected polynomial 0x82F63B78, bit by bit: records are small and written once per step. */
static uint32_t crc32c(const uint8_t *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    }
    return ~c;
}

static uint32_t masked_crc(const uint8_t *p, size_t n) {
    uint32_t c = crc32c(p, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

static void put_le(uint8_t *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* Push the framed record of ev. */
static void push_record(lua_State *L, const Ds4tb__Event *ev) {
    size_t n = ds4tb__event__get_packed_size(ev);
    uint8_t *buf = lua_newuserdata(L, n + 16);
    put_le(buf, n, 8);
    put_le(buf + 8, masked_crc(buf, 8), 4);
    ds4tb__event__pack(ev, buf + 12);
    put_le(buf + 12 + n, masked_crc(buf + 12, n), 4);
    lua_pushlstring(L, (const char *)buf, n + 16);
    lua_remove(L, -2);
}

static double check_wall(lua_State *L, const char *fname) {
    if (lua_type(L, 1) != LUA_TNUMBER || !isfinite(lua_tonumber(L, 1)) || lua_tonumber(L, 1) < 0)
        ds4l_raise(L, "%s: bad argument #1 (wall time in seconds expected, got %s)", fname, luaL_typename(L, 1));
    return lua_tonumber(L, 1);
}

static int64_t check_step(lua_State *L, const char *fname) {
    lua_Number v = lua_tonumber(L, 2);
    if (lua_type(L, 2) != LUA_TNUMBER || !(v == floor(v)) || !(fabs(v) < 9e15))
        ds4l_raise(L, "%s: bad argument #2 (integer step expected, got %s)", fname,
                   lua_type(L, 2) == LUA_TNUMBER ? lua_tostring(L, 2) : luaL_typename(L, 2));
    return (int64_t)v;
}

static int l_file_version(lua_State *L) {
    Ds4tb__Event ev = DS4TB__EVENT__INIT;
    ev.wall_time = check_wall(L, "ds4.tb.file_version");
    ev.what_case = DS4TB__EVENT__WHAT_FILE_VERSION;
    ev.file_version = (char *)"brain.Event:2";
    push_record(L, &ev);
    return 1;
}

static int cmp_tag(const void *a, const void *b) {
    return strcmp((*(Ds4tb__SummaryValue *const *)a)->tag, (*(Ds4tb__SummaryValue *const *)b)->tag);
}

static int l_scalars(lua_State *L) {
    const char *fname = "ds4.tb.scalars";
    Ds4tb__Event ev = DS4TB__EVENT__INIT;
    ev.wall_time = check_wall(L, fname);
    ev.step = check_step(L, fname);
    luaL_checktype(L, 3, LUA_TTABLE);
    size_t n = 0;
    lua_pushnil(L);
    while (lua_next(L, 3)) {
        if (lua_type(L, -2) != LUA_TSTRING || lua_type(L, -1) != LUA_TNUMBER)
            ds4l_raise(L, "%s: bad argument #3 (a table of tag = number expected, got a %s = %s entry)", fname,
                       luaL_typename(L, -2), luaL_typename(L, -1));
        lua_pop(L, 1);
        n++;
    }
    /* values and pointers to them in one scratch block (the tags point into the table's key strings) */
    uint8_t *mem = lua_newuserdata(L, (n ? n : 1) * (sizeof(Ds4tb__SummaryValue) + sizeof(Ds4tb__SummaryValue *)));
    Ds4tb__SummaryValue *vals = (Ds4tb__SummaryValue *)mem;
    Ds4tb__SummaryValue **ptrs = (Ds4tb__SummaryValue **)(mem + (n ? n : 1) * sizeof(Ds4tb__SummaryValue));
    size_t k = 0;
    lua_pushnil(L);
    while (lua_next(L, 3)) {
        Ds4tb__SummaryValue init = DS4TB__SUMMARY_VALUE__INIT;
        vals[k] = init;
        vals[k].tag = (char *)lua_tostring(L, -2);
        vals[k].value_case = DS4TB__SUMMARY_VALUE__VALUE_SIMPLE_VALUE;
        vals[k].simple_value = (float)lua_tonumber(L, -1);
        ptrs[k] = &vals[k];
        k++;
        lua_pop(L, 1);
    }
    qsort(ptrs, n, sizeof *ptrs, cmp_tag); /* the same table gives the same bytes */
    Ds4tb__Summary sum = DS4TB__SUMMARY__INIT;
    sum.n_value = n;
    sum.value = ptrs;
    ev.what_case = DS4TB__EVENT__WHAT_SUMMARY;
    ev.summary = &sum;
    push_record(L, &ev);
    return 1;
}

static int l_text(lua_State *L) {
    const char *fname = "ds4.tb.text";
    Ds4tb__Event ev = DS4TB__EVENT__INIT;
    ev.wall_time = check_wall(L, fname);
    ev.step = check_step(L, fname);
    const char *tag = luaL_checkstring(L, 3);
    size_t rows = 0, cols = 0;
    int t = lua_type(L, 4);
    if (t == LUA_TTABLE) {
        rows = lua_objlen(L, 4);
        for (size_t r = 1; r <= rows; r++) {
            lua_rawgeti(L, 4, (int)r);
            if (!lua_istable(L, -1)) ds4l_raise(L, "%s: rows[%zu] must be an array of strings", fname, r);
            size_t c = lua_objlen(L, -1);
            if (r == 1) cols = c;
            if (c != cols || c == 0)
                ds4l_raise(L, "%s: rows[%zu] has %zu cells, rows[1] %zu: a table needs equal, non-empty rows", fname,
                           r, c, cols);
            lua_pop(L, 1);
        }
        if (rows == 0) ds4l_raise(L, "%s: no rows", fname);
    } else if (t != LUA_TSTRING) {
        ds4l_raise(L, "%s: bad argument #4 (a string or an array of rows of strings expected, got %s)", fname,
                   luaL_typename(L, 4));
    }
    size_t n = t == LUA_TSTRING ? 1 : rows * cols;
    ProtobufCBinaryData *cells = lua_newuserdata(L, n * sizeof *cells);
    if (t == LUA_TSTRING) {
        cells[0].data = (uint8_t *)lua_tolstring(L, 4, &cells[0].len);
    } else {
        for (size_t r = 0; r < rows; r++) {
            lua_rawgeti(L, 4, (int)r + 1);
            for (size_t c = 0; c < cols; c++) {
                lua_rawgeti(L, -1, (int)c + 1);
                if (lua_type(L, -1) != LUA_TSTRING) /* not lua_isstring: tolstring would rewrite a number in place */
                    ds4l_raise(L, "%s: rows[%zu][%zu] must be a string, got %s", fname, r + 1, c + 1,
                               luaL_typename(L, -1));
                /* anchored by the rows table, which the caller's argument keeps alive */
                cells[r * cols + c].data = (uint8_t *)lua_tolstring(L, -1, &cells[r * cols + c].len);
                lua_pop(L, 1);
            }
            lua_pop(L, 1);
        }
    }
    Ds4tb__TensorShapeDim d0 = DS4TB__TENSOR_SHAPE_DIM__INIT, d1 = DS4TB__TENSOR_SHAPE_DIM__INIT;
    d0.size = (int64_t)rows;
    d1.size = (int64_t)cols;
    Ds4tb__TensorShapeDim *dims[2] = {&d0, &d1};
    Ds4tb__TensorShape shape = DS4TB__TENSOR_SHAPE__INIT;
    shape.n_dim = t == LUA_TSTRING ? 0 : 2;
    shape.dim = dims;
    Ds4tb__Tensor tensor = DS4TB__TENSOR__INIT;
    tensor.dtype = DT_STRING;
    tensor.tensor_shape = &shape;
    tensor.n_string_val = n;
    tensor.string_val = cells;
    Ds4tb__PluginData plugin = DS4TB__PLUGIN_DATA__INIT;
    plugin.plugin_name = (char *)"text";
    Ds4tb__SummaryMetadata meta = DS4TB__SUMMARY_METADATA__INIT;
    meta.plugin_data = &plugin;
    Ds4tb__SummaryValue val = DS4TB__SUMMARY_VALUE__INIT;
    val.tag = (char *)tag;
    val.metadata = &meta;
    val.value_case = DS4TB__SUMMARY_VALUE__VALUE_TENSOR;
    val.tensor = &tensor;
    Ds4tb__SummaryValue *vp = &val;
    Ds4tb__Summary sum = DS4TB__SUMMARY__INIT;
    sum.n_value = 1;
    sum.value = &vp;
    ev.what_case = DS4TB__EVENT__WHAT_SUMMARY;
    ev.summary = &sum;
    push_record(L, &ev);
    return 1;
}

static int l_crc32c(lua_State *L) {
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    lua_pushnumber(L, (lua_Number)crc32c((const uint8_t *)s, n));
    return 1;
}

void ds4l_tb_open(lua_State *L) {
    static const luaL_Reg fns[] = {
        {"file_version", l_file_version}, {"scalars", l_scalars}, {"text", l_text}, {"crc32c", l_crc32c}, {NULL, NULL},
    };
    lua_newtable(L);
    for (const luaL_Reg *r = fns; r->name; r++) {
        lua_pushcfunction(L, r->func);
        lua_setfield(L, -2, r->name);
    }
    lua_setfield(L, -2, "tb");
}
