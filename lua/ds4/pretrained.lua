--[==[ ds4.pretrained — the tokenizer files of a saved model directory, so that a model is saved and loaded whole.

  local pre = require("ds4.pretrained")
  pre.files(tok [, {chat_template = name, config = table}]) -> {["tokenizer.json"] = text, ["tokenizer_config.json"] = text}
  pre.read(dir) -> tok, {chat_template = name | nil, config = table | nil} | nil when dir has no tokenizer.json
  pre.template_for(tok [, config]) -> the ds4 chat template name for this tokenizer, or nil

What is written (the Hugging Face layout, so that AutoTokenizer.from_pretrained(dir) loads it too):
  tokenizer.json         the text the tokenizer was loaded from (tok:to_json(); the built-in byte-level tokenizer's
                         is a byte-level BPE with 256 byte tokens and the DeepSeek special tokens): loading it gives
                         the same ids for every text
  tokenizer_config.json  the loaded model's own tokenizer_config.json when there was one (its Jinja chat_template,
                         model_max_length, ... kept), else {"tokenizer_class": "PreTrainedTokenizerFast"}; plus
                         bos_token / eos_token / pad_token when the tokenizer has the DeepSeek ones and they are not
                         set, and "ds4_chat_template": the name of the ds4 chat template (ds4.chat.get) a chat with
                         this model is rendered with
On reading, the template is "ds4_chat_template" when present, else the guess template_for makes: "deepseek_v4"
for a tokenizer with the DeepSeek chat tokens, "chatml" for one with <|im_start|>, nil otherwise.

ds4.load(dir) attaches what pre.read finds to the model (model:tokenizer()), and model:save / ds4.checkpoints.save
write the attached tokenizer back (lua/ds4/init.lua): a checkpoint never silently loses its tokenizer.
]==]

local json = require("ds4.chat.json")

local M = {}

function M.template_for(tok, config)
    if type(config) == "table" and type(config.ds4_chat_template) == "string" then return config.ds4_chat_template end
    if tok:special("assistant") and tok:special("eos") then return "deepseek_v4" end
    if tok:token_to_id("<|im_start|>") then return "chatml" end
    return nil
end

local function token_text(tok, name)
    local id = tok:special(name)
    return id and tok:id_to_token(id) or nil
end

function M.files(tok, opts)
    opts = opts or {}
    if type(opts) ~= "table" then error("ds4.pretrained.files: opts must be a table, got " .. type(opts), 2) end
    local cfg = {}
    local src = opts.config
    if type(src) == "table" then
        local keys = json.keys(src) or {}
        if #keys == 0 then for k in pairs(src) do keys[#keys + 1] = k end table.sort(keys) end
        local kv = {}
        for _, k in ipairs(keys) do kv[#kv + 1] = k; kv[#kv + 1] = src[k] end
        cfg = json.object(kv)
    else
        cfg = json.object({ "tokenizer_class", "PreTrainedTokenizerFast", "clean_up_tokenization_spaces", false })
    end
    for key, name in pairs({ bos_token = "bos", eos_token = "eos", pad_token = "eos" }) do
        if cfg[key] == nil then
            local text = token_text(tok, name)
            if text then cfg[key] = text end
        end
    end
    local template = opts.chat_template or M.template_for(tok, src)
    if template then cfg.ds4_chat_template = template end
    return { ["tokenizer.json"] = tok:to_json(), ["tokenizer_config.json"] = json.encode(cfg) .. "\n" }
end

function M.read(dir)
    local path = dir .. "/tokenizer.json"
    local f = io.open(path, "rb")
    if not f then return nil end
    f:close()
    local ds4 = require("ds4")
    local tok = ds4.tokenizer(path)
    local config
    local cpath = dir .. "/tokenizer_config.json"
    local cf = io.open(cpath, "rb")
    if cf then
        local text = cf:read("*a")
        cf:close()
        local v, why = json.decode(text or "")
        if type(v) ~= "table" or json.keys(v) == nil then
            error(("%s: not a JSON object (%s)"):format(cpath, tostring(why or "an array or a scalar")), 0)
        end
        config = v
    end
    return tok, { chat_template = M.template_for(tok, config), config = config }
end

return M
