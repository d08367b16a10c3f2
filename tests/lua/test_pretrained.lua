-- test_pretrained.lua — a saved model is complete (issue 17): model:save and ds4.checkpoints.save write the
-- tokenizer (tokenizer.json, tokenizer_config.json with the special tokens and the chat template's name) with the
-- weights, ds4.load attaches it again, and the reloaded tokenizer gives the original's ids on every test text.
--   (a) tok:to_json() is the loaded file byte for byte (the DeepSeek fixture tokenizer), and the built-in one's
--       JSON loads back to a tokenizer with its ids;
--   (b) model:save + ds4.load: tokenizer, template name, tokenizer_config.json fields; a source
--       tokenizer_config.json (Jinja chat_template, model_max_length) is kept; opts.tokenizer = false writes none;
--   (c) ds4.checkpoints.save: the files are inside the checksummed checkpoint (COMPLETE lists them);
--   (d) errors: a bad file name, a broken tokenizer_config.json named by ds4.load.
-- Usage: ds4 run tests/lua/test_pretrained.lua <fixtures_dir>
package.path = ((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;") .. package.path
local H = require("harness")
local ds4 = require("ds4")
local json = require("ds4.chat.json")

local FIX = H.fixtures()
local TEXTS = { "hello world", "  two  spaces\n\nand lines", "wörld ünïcode 漢字 🙂", "<｜User｜>hi<｜Assistant｜>",
    "a+b=\\boxed{12}", "", "\0\1\255 bytes" }

local function same_ids(a, b, what)
    for _, s in ipairs(TEXTS) do
        H.same(b:encode(s), a:encode(s), what .. ": " .. ("%q"):format(s))
    end
end

-- (a)
local deepseek = FIX .. "/tokenizer/deepseek.json"
local tk = ds4.tokenizer(deepseek)
H.eq(tk:to_json(), H.read_file(deepseek), "to_json is the file it was loaded from")
local byte = ds4.tokenizer()
local tmp = H.make_temp_dir()
local f = assert(io.open(tmp .. "/byte.json", "wb"))
f:write(byte:to_json())
f:close()
same_ids(byte, ds4.tokenizer(tmp .. "/byte.json"), "built-in tokenizer written and loaded")

-- (b)
local model = ds4.load(FIX .. "/tiny_a")
H.eq(model:tokenizer(), nil, "a checkpoint without tokenizer.json has no tokenizer attached")
model:set_tokenizer(byte)
local t0, name0 = model:tokenizer()
H.eq(t0, byte, "set_tokenizer attaches")
H.eq(name0, "deepseek_v4", "the DeepSeek chat tokens pick the deepseek_v4 template")
model:save(tmp .. "/m1")
local m1 = ds4.load(tmp .. "/m1")
local t1, name1 = m1:tokenizer()
H.check(ds4.is_tokenizer(t1), "ds4.load attaches the saved tokenizer")
H.eq(name1, "deepseek_v4", "template name read back")
same_ids(byte, t1, "saved and reloaded")
local cfg = json.decode(H.read_file(tmp .. "/m1/tokenizer_config.json"))
H.eq(cfg.ds4_chat_template, "deepseek_v4", "tokenizer_config.json names the template")
H.eq(cfg.eos_token, ds4.special_tokens().eos, "eos_token")
H.eq(cfg.bos_token, ds4.special_tokens().bos, "bos_token")
H.eq(cfg.tokenizer_class, "PreTrainedTokenizerFast", "tokenizer_class for AutoTokenizer")
-- a chatml model saved with an explicit template and a source config that must be kept
model:set_tokenizer(tk, { chat_template = "chatml", config = json.decode(
    '{"model_max_length": 4096, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}') })
model:save(tmp .. "/m2")
local m2 = ds4.load(tmp .. "/m2")
local t2, name2 = m2:tokenizer()
H.eq(name2, "chatml", "an explicit template name survives the save")
same_ids(tk, t2, "the fixture tokenizer saved and reloaded")
local cfg2 = json.decode(H.read_file(tmp .. "/m2/tokenizer_config.json"))
H.eq(cfg2.model_max_length, 4096, "the source tokenizer_config.json fields are kept")
H.eq(cfg2.chat_template, "{% for m in messages %}{{ m.content }}{% endfor %}", "its Jinja chat_template too")
model:save(tmp .. "/m3", { tokenizer = false })
H.eq(io.open(tmp .. "/m3/tokenizer.json"), nil, "opts.tokenizer = false writes no tokenizer")
H.eq(ds4.load(tmp .. "/m3"):tokenizer(), nil, "and none is attached on load")
model:save(tmp .. "/m4", { tokenizer = byte, chat_template = "deepseek_v4" })
local _, name4 = ds4.load(tmp .. "/m4"):tokenizer()
H.eq(name4, "deepseek_v4", "opts.tokenizer / opts.chat_template override the attached ones")

-- (c)
local dir = ds4.checkpoints.save(tmp .. "/ck", 3, m1)
H.check(io.open(dir .. "/tokenizer.json") ~= nil, "the checkpoint holds tokenizer.json")
local marker = json.decode(H.read_file(dir .. "/COMPLETE"))
local listed = {}
for _, e in ipairs(marker.files) do listed[e.name] = e.size end
H.eq(listed["tokenizer.json"], #byte:to_json(), "COMPLETE lists tokenizer.json with its size")
H.check(listed["tokenizer_config.json"] ~= nil, "COMPLETE lists tokenizer_config.json")
local cdir = ds4.checkpoints.load(tmp .. "/ck")
local tc = ds4.load(cdir):tokenizer()
same_ids(byte, tc, "a checkpoint's tokenizer")

-- (d)
H.raises(function() m1:save(tmp .. "/bad", { files = { ["../evil.json"] = "{}" } }) end,
    { "ds4.model:save", "'../evil.json' is not a plain *.json file name" }, "a file name with a path is refused")
H.raises(function() m1:save(tmp .. "/bad", { files = { ["config.json"] = "{}" } }) end, "not config.json",
    "the weights' config cannot be replaced")
H.raises(function() m1:save(tmp .. "/bad", { tokenizer = "byte" }) end,
    "ds4.model:save: opts.tokenizer must be a ds4.tokenizer or false", "a tokenizer name is not a tokenizer")
H.eq(io.open(tmp .. "/bad/config.json"), nil, "a refused save writes nothing")
f = assert(io.open(tmp .. "/m1/tokenizer_config.json", "wb"))
f:write("[1, 2")
f:close()
H.raises(function() ds4.load(tmp .. "/m1") end, { "ds4.load:", "m1/tokenizer_config.json: not a JSON object" },
    "a broken tokenizer_config.json is named")

os.execute("rm -rf " .. H.shell_quote(tmp))
H.done("test_pretrained")
